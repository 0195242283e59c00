"""Episode rows of hand-started remote actors, carried to the run's results directory by the replay service.

A remote actor (`python -m actorq_jax.launch.actor --server HOST:PORT`) may run on a
machine that shares no disk with the launcher. Besides its own CSV (its copy, kept
whatever happens to the service), it inserts each finished episode's row into the
ACTOR_ROWS_TABLE of the run's Reverb server (`RowForwarder`). The replay service drains
that table about twice a second into actors/actor_<id>.csv of its results directory
(`RowDrain`). Under `--launcher ray` every actor sends its rows this way, the launcher's
own included, and the launcher's process (which owns the results directory) runs the
`RowDrain` instead of the service. Locally, actors the launcher starts write their CSV
directly and do not use this table.

Rows travel as JSON text (no pickle on the wire) and are checked on arrival: a row
that is not a well-formed actor row, or that claims a launcher actor's id, is counted
and dropped, never written.
"""

import collections
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from actorq_jax.run_dir import RunDir

log = logging.getLogger(__name__)

ACTOR_ROWS_TABLE = "actor_rows"
# The service's acknowledgements of the rows it wrote (newest episode per sender), read by every sender.
ROWS_WRITTEN_TABLE = "actor_rows_written"
# A forwarded row not acknowledged within this long is sent again (its first copy died with a service).
RESEND_S = 10.0
# Rows the table holds before the oldest is dropped (a service that does not drain); the
# remote actor's own CSV still has them.
MAX_PENDING_ROWS = 10_000
# A remote actor keeps at most this many rows it could not send yet (its CSV has them all).
MAX_UNSENT_ROWS = 10_000
# The longest encoded row accepted: an actor row is a few hundred bytes.
MAX_ROW_BYTES = 16_384


def make_actor_rows_tables() -> List[Any]:
    """The FIFO table remote actors insert episode rows into (each row read once by the replay service), and the
    table of its acknowledgements."""
    from actorq_jax.replay import make_variables_table
    from actorq_jax.replay.messages import make_message_table

    return [make_message_table(ACTOR_ROWS_TABLE, max_size=MAX_PENDING_ROWS), make_variables_table(ROWS_WRITTEN_TABLE)]


def encode_row(row: Mapping[str, Any]) -> np.ndarray:
    """An actor row as JSON bytes (uint8), the form it travels in."""
    from actorq_jax.replay.messages import encode_message

    return encode_message(row)


def decode_row(data: Any) -> Dict[str, Any]:
    """The actor row in `data` (uint8 JSON bytes); ValueError saying what is wrong with it."""
    from actorq_jax.replay.messages import decode_message
    from actorq_jax.telemetry import ACTOR_FIELDS

    row = decode_message(data, what="row", max_bytes=MAX_ROW_BYTES)
    unknown = sorted(set(row) - set(ACTOR_FIELDS))
    if unknown:
        raise ValueError(f"unknown columns {unknown}")
    actor_id = row.get("actor_id")
    if isinstance(actor_id, bool) or not isinstance(actor_id, int) or actor_id < 0:
        raise ValueError(f"actor_id must be an int >= 0, got {actor_id!r}")
    bad = {k: v for k, v in row.items()
           if not (v is None or isinstance(v, (int, str)) or (isinstance(v, float) and not math.isinf(v)))}
    if bad:
        raise ValueError(f"values that are not numbers or text: {bad}")
    return row


def row_identity(row: Mapping[str, Any]) -> Optional[Tuple[int, str, int]]:
    """(actor_id, incarnation, episode) of a row, or None for a row without an incarnation."""
    incarnation = row.get("incarnation")
    if incarnation in (None, ""):
        return None
    return int(row["actor_id"]), str(incarnation), int(row["episode"])


def read_written(client: Any, timeout_s: int = 5) -> Dict[str, int]:
    """The service's acknowledgements: {"<actor_id>/<incarnation>": newest episode written} ({} before any)."""
    from actorq_jax.replay.messages import sample_one

    if int(client.server_info(timeout=timeout_s)[ROWS_WRITTEN_TABLE].current_size) == 0:
        return {}
    sample = sample_one(client, ROWS_WRITTEN_TABLE, timeout_s)
    return dict(json.loads(bytes(sample.data[0]).decode()))


class RowForwarder:
    """A remote actor's side: each finished episode's row goes to the replay service and stays in the outbox until
    the service says it wrote it; a row unacknowledged for RESEND_S (the service died before writing it) is sent
    again, and the service writes each row once."""

    def __init__(self, address: str, timeout_s: float):
        self._address = address
        self._client: Any = None
        self._timeout_ms = max(1, int(timeout_s * 1000))
        # identity -> (encoded row, when last sent or None); oldest first.
        self._outbox: "collections.OrderedDict[Tuple[int, str, int], Tuple[np.ndarray, Optional[float]]]" = \
            collections.OrderedDict()
        self.sent = 0

    @property
    def unsent(self) -> int:
        """Rows the service has not acknowledged (yet)."""
        return len(self._outbox)

    def send(self, row: Mapping[str, Any]) -> None:
        """Queues `row` (it must carry an incarnation) and sends what is due (each insert bounded by the timeout)."""
        identity = row_identity(row)
        if identity is None:
            raise ValueError(f"a forwarded row needs an incarnation, got {dict(row)!r}")
        self._outbox[identity] = (encode_row(row), None)
        while len(self._outbox) > MAX_UNSENT_ROWS:
            self._outbox.popitem(last=False)  # the actor's own CSV keeps it
        self.flush()

    def flush(self) -> bool:
        """Drops acknowledged rows, sends those due in order until one fails; whether every row was sent."""
        import reverb

        if not self._outbox:
            return True
        try:
            if self._client is None:
                self._client = reverb.Client(self._address)
            self._drop_acknowledged()
            now = time.monotonic()
            for identity, (data, sent_at) in list(self._outbox.items()):
                if sent_at is None or now - sent_at >= RESEND_S:
                    self._insert(data)
                    self._outbox[identity] = (data, now)
                    self.sent += 1
        except (reverb.DeadlineExceededError, RuntimeError) as error:
            # The service is away (restarting, or gone): the rows stay queued, and in the actor's CSV.
            log.debug("could not forward an episode row: %s", error)
            # A fresh client next time: a channel that saw its server go backs off for minutes.
            self._client = None
            return False
        return True

    def wait_acknowledged(self, timeout_s: float) -> bool:
        """Flushes until the service acknowledged every row or `timeout_s` passes; whether it did."""
        deadline = time.monotonic() + timeout_s
        while self._outbox and time.monotonic() < deadline:
            self.flush()
            if self._outbox:
                time.sleep(0.2)
        return not self._outbox

    def _drop_acknowledged(self) -> None:
        written = read_written(self._client)
        for identity in list(self._outbox):
            actor_id, incarnation, episode = identity
            if episode <= written.get(f"{actor_id}/{incarnation}", 0):
                del self._outbox[identity]

    def _insert(self, data: np.ndarray) -> None:
        writer = self._client.trajectory_writer(num_keep_alive_refs=1, validate_items=False)
        try:
            writer.append([data])
            writer.create_item(ACTOR_ROWS_TABLE, 1.0, [writer.history[0][-1]])
            writer.end_episode(timeout_ms=self._timeout_ms)
        finally:
            writer.close()


class RowDrain:
    """The replay service's side: moves rows from the actor_rows table into actors/<actor_id>.csv under `actors_dir`."""

    def __init__(self, client: Any, actors_dir: Path, num_local_actors: int):
        self._client = client
        self._dir = Path(actors_dir)
        self._num_local = int(num_local_actors)
        self._loggers: Dict[int, Any] = {}
        self.rejected = 0
        self.duplicates = 0
        # Every row identity already in the results directory (a restarted service reads them back), and the
        # newest episode written per sender: what the senders' outboxes may let go of.
        self._written: set = set()
        self._acked: Dict[str, int] = {}
        for path in sorted(self._dir.glob(RunDir.ACTOR_CSV_GLOB)):
            for row in _read_csv(path):
                identity = row_identity(row)
                if identity is not None:
                    self._remember(identity)
        self._publish_acks()

    def _remember(self, identity: Tuple[int, str, int]) -> None:
        self._written.add(identity)
        key = f"{identity[0]}/{identity[1]}"
        self._acked[key] = max(self._acked.get(key, 0), identity[2])

    def _publish_acks(self) -> None:
        self._client.insert([np.frombuffer(json.dumps(self._acked).encode(), np.uint8)], {ROWS_WRITTEN_TABLE: 1.0})

    def discard(self) -> None:
        """Empties the table: rows restored from a replay checkpoint were drained before the crash."""
        self._client.reset(ACTOR_ROWS_TABLE)

    def drain(self, timeout_s: int = 5) -> int:
        """Writes every row waiting in the table to its actor's CSV; how many were written."""
        from actorq_jax.replay.messages import sample_within

        size = int(self._client.server_info(timeout=timeout_s)[ACTOR_ROWS_TABLE].current_size)
        if size == 0:
            return 0
        # Only this drain removes rows, and an overflowing table drops one row per row added, so `size` rows
        # are there to read, unless the server restarted since (then its table is empty: bounded).
        written = 0
        for sample in sample_within(self._client, ACTOR_ROWS_TABLE, size, timeout_s):
            try:
                row = decode_row(sample.data[0])
                taken = check_remote_actor_id(row["actor_id"], self._num_local)
                if taken:
                    raise ValueError(taken)
            except ValueError as error:
                self.rejected += 1
                log.warning("dropped a remote actor's episode row (%d so far): %s", self.rejected, error)
                continue
            identity = row_identity(row)
            if identity is not None and identity in self._written:
                self.duplicates += 1  # sent again after a lost acknowledgement: written already
                continue
            self._logger(row["actor_id"]).write(row)
            if identity is not None:
                self._remember(identity)
            written += 1
        self._publish_acks()
        return written

    def close(self) -> None:
        """Flushes and closes the CSV files."""
        for logger in self._loggers.values():
            logger.close()
        self._loggers.clear()

    def _logger(self, actor_id: int) -> Any:
        from actorq_jax.telemetry import ACTOR_FIELDS
        from actorq_jax.telemetry.csv_logger import open_run_csv

        if actor_id not in self._loggers:
            # Flushed at once, as the actors' own files are: a killed service loses no drained row.
            self._loggers[actor_id] = open_run_csv(self._dir / RunDir.actor_file(actor_id), ACTOR_FIELDS,
                                                   flush_every_s=0)
        return self._loggers[actor_id]


def check_remote_actor_id(actor_id: int, num_local_actors: int) -> Optional[str]:
    """Why `actor_id` cannot join a run of `num_local_actors` launcher actors, or None."""
    if actor_id < 0:
        return f"--actor_id must be >= 0, got {actor_id}"
    if actor_id < num_local_actors:
        return (f"--actor_id {actor_id} is one of the run's {num_local_actors} launcher actors "
                f"(ids 0-{num_local_actors - 1}); pick an id >= {num_local_actors}")
    return None


def _read_csv(path: Path) -> List[Dict[str, Any]]:
    from actorq_jax.telemetry import read_csv

    try:
        return read_csv(path)
    except (FileNotFoundError, ValueError):
        return []
