"""The run's control plane: the status reports of the launcher, the replay service, the learner and the evaluator.

A `RunChannel` carries one small JSON report per role: `report(role, status)`
replaces it, `read(role)` returns the last one ({} before the first). Every
process of a run picks its channel once (`make_channel`): `FileChannel`
(status/<role>.json, replaced atomically) for local runs, whose processes share
a disk; `ServiceChannel` (one size-1 table per role on the run's Reverb server,
created by the replay service with its other tables) under `--launcher ray`,
where the driver's channel also records what it reads into status/<role>.json,
so the results directory has the same files as a local run's.
"""

import json
import logging
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol

from actorq_jax.run_dir import RunDir

log = logging.getLogger(__name__)

ROLES = ("launcher", "replay", "learner", "evaluator")
# How long one read or report waits for the server (a reader polls; a report is retried at the next one).
CALL_TIMEOUT_S = 2
# Stamps on each report in a status table: which channel wrote it and its count there. A report that timed
# out can still land after a newer one (its insert was in flight when the writer gave up), replacing it.
WRITER_KEY, SEQ_KEY = "_channel_writer", "_channel_seq"


class RunChannel(Protocol):
    """Where a run's processes report their status and read each other's."""

    def report(self, role: str, status: Dict[str, Any]) -> None:
        """Replaces `role`'s report with `status`."""

    def read(self, role: str) -> Dict[str, Any]:
        """`role`'s last report ({} before the first, or while it cannot be read)."""


def status_table(role: str) -> str:
    """The Reverb table holding `role`'s report."""
    if role not in ROLES:
        raise ValueError(f"no status table for role {role!r}; roles: {ROLES}")
    return f"status_{role}"


def make_status_tables() -> List[Any]:
    """The size-1 tables the replay service serves for the ServiceChannel (one per role)."""
    from actorq_jax.replay import make_variables_table

    return [make_variables_table(status_table(role)) for role in ROLES]


class FileChannel:
    """Reports as status/<role>.json under a results directory (atomic replace)."""

    def __init__(self, results_dir: Path):
        self.results_dir = Path(results_dir)

    def path(self, role: str) -> Path:
        """The file holding `role`'s report."""
        return RunDir(self.results_dir).status_file(role)

    def report(self, role: str, status: Dict[str, Any]) -> None:
        """Writes `role`'s report atomically."""
        from actorq_jax.telemetry import write_json

        write_json(self.path(role), status)

    def read(self, role: str) -> Dict[str, Any]:
        """`role`'s last report ({} before the first)."""
        try:
            return dict(json.loads(self.path(role).read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}


class ServiceChannel:
    """Reports in the status tables of the run's Reverb server at `address`."""

    def __init__(self, address: str):
        self.address = address
        self._client: Any = None
        self._writer = uuid.uuid4().hex  # this channel's reports carry it with a count, so readers can order them
        self._sent = 0
        self._newest: Dict[str, Dict[str, Any]] = {}  # per role: the newest report read (stamps included)
        self._retired: Dict[str, set] = {}  # per role: writers replaced by a newer one (a restarted worker's)

    def _connected(self) -> Any:
        import reverb

        if self._client is None:
            self._client = reverb.Client(self.address)
        return self._client

    def report(self, role: str, status: Dict[str, Any]) -> None:
        """Replaces `role`'s report (one the server does not take in time is dropped: the next replaces it)."""
        import reverb

        from actorq_jax.replay.messages import send_message
        from actorq_jax.telemetry.jsonio import to_jsonable

        self._sent += 1
        stamped = {**to_jsonable(status), WRITER_KEY: self._writer, SEQ_KEY: self._sent}
        try:
            send_message(self._connected(), status_table(role), stamped, CALL_TIMEOUT_S)
        except (reverb.DeadlineExceededError, RuntimeError) as error:
            self._client = None  # a channel that saw its server go backs off: a fresh one next time
            log.warning("the %s report did not reach %s: %s", role, self.address, error)

    def read(self, role: str) -> Dict[str, Any]:
        """`role`'s last report ({} before the first, or while the server does not answer)."""
        import reverb

        from actorq_jax.replay.messages import decode_message, sample_one

        table = status_table(role)
        try:
            client = self._connected()
            if int(client.server_info(timeout=CALL_TIMEOUT_S)[table].current_size) == 0:
                return {}
            # Size-1 tables never empty once filled (an insert replaces the item), but a restarted server's do.
            sample = sample_one(client, table, CALL_TIMEOUT_S)
            report = self._newer(role, decode_message(sample.data[0]))
        except (reverb.DeadlineExceededError, RuntimeError, ConnectionError, KeyError, ValueError):
            self._client = None
            return {}
        return {k: v for k, v in report.items() if k not in (WRITER_KEY, SEQ_KEY)}

    def _newer(self, role: str, report: Dict[str, Any]) -> Dict[str, Any]:
        """`report`, unless it is older than the newest read before (then that one): a late report never wins."""
        newest = self._newest.get(role)
        writer, seq = report.get(WRITER_KEY), report.get(SEQ_KEY, 0)
        retired = self._retired.setdefault(role, set())
        if newest is not None and writer is not None:
            if writer in retired or (writer == newest.get(WRITER_KEY) and seq < newest.get(SEQ_KEY, 0)):
                return newest
            if writer != newest.get(WRITER_KEY):  # a new writer (a restarted worker): the old one's reports are stale
                retired.add(newest.get(WRITER_KEY))
        self._newest[role] = report
        return report


class RecordedChannel:
    """A channel whose reports, and the reports read through it, are also written as status/<role>.json files."""

    def __init__(self, channel: RunChannel, record: FileChannel):
        self.channel = channel
        self.record = record
        self._last: Dict[str, Dict[str, Any]] = {}

    def report(self, role: str, status: Dict[str, Any]) -> None:
        """Reports through the channel and records the report."""
        self.channel.report(role, status)
        self._keep(role, status)

    def read(self, role: str) -> Dict[str, Any]:
        """Reads through the channel, recording a report not seen before."""
        status = self.channel.read(role)
        if status:
            self._keep(role, status)
        return status

    def _keep(self, role: str, status: Dict[str, Any]) -> None:
        if self._last.get(role) != status:
            self.record.report(role, status)
            self._last[role] = dict(status)


def make_channel(run: Any, results_dir: Path, address: Optional[str] = None, record: bool = False) -> RunChannel:
    """The channel of one process: status files for local runs, the service's tables under `--launcher ray`
    (`record`: the driver's, which also writes what it sees into results_dir/status/)."""
    if run.launcher != "ray":
        return FileChannel(results_dir)
    if not address:
        raise ValueError("a run under --launcher ray reports through its replay service: an address is needed")
    channel = ServiceChannel(address)
    return RecordedChannel(channel, FileChannel(results_dir)) if record else channel
