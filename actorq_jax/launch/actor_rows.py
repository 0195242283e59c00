"""Episode rows of hand-started remote actors, carried to the run's results directory by the replay service.

A remote actor (`python -m actorq_jax.launch.actor --server HOST:PORT`) may run on a
machine that shares no disk with the launcher. Besides its own CSV (its copy, kept
whatever happens to the service), it inserts each finished episode's row into the
ACTOR_ROWS_TABLE of the run's Reverb server (`RowForwarder`). The replay service drains
that table about twice a second into actors/actor_<id>.csv of its results directory
(`RowDrain`); under `--launcher ray` the driver mirrors that file like every other
file the service writes. So a remote actor's rows reach the results directory by the
same road as everything else from the service's node. Actors the launcher starts
write their CSV directly and do not use this table.

Rows travel as JSON text (no pickle on the wire) and are checked on arrival: a row
that is not a well-formed actor row, or that claims a launcher actor's id, is counted
and dropped, never written.
"""

import collections
import logging
import math
from pathlib import Path
from typing import Any, Deque, Dict, Mapping, Optional

import numpy as np

log = logging.getLogger(__name__)

ACTOR_ROWS_TABLE = "actor_rows"
# Rows the table holds before the oldest is dropped (a service that does not drain); the
# remote actor's own CSV still has them.
MAX_PENDING_ROWS = 10_000
# A remote actor keeps at most this many rows it could not send yet (its CSV has them all).
MAX_UNSENT_ROWS = 10_000
# The longest encoded row accepted: an actor row is a few hundred bytes.
MAX_ROW_BYTES = 16_384


def make_actor_rows_table() -> Any:
    """The FIFO table remote actors insert episode rows into; each row is read once by the replay service."""
    from actorq_jax.replay.messages import make_message_table

    return make_message_table(ACTOR_ROWS_TABLE, max_size=MAX_PENDING_ROWS)


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


class RowForwarder:
    """A remote actor's side: sends each finished episode's row to the replay service; unsent rows wait for the next try."""

    def __init__(self, address: str, timeout_s: float):
        self._address = address
        self._client: Any = None
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._unsent: Deque[np.ndarray] = collections.deque(maxlen=MAX_UNSENT_ROWS)
        self.sent = 0

    @property
    def unsent(self) -> int:
        """Rows not (yet) on the replay service."""
        return len(self._unsent)

    def send(self, row: Mapping[str, Any]) -> None:
        """Queues `row` and sends what is queued (each insert bounded by the timeout)."""
        self._unsent.append(encode_row(row))
        self.flush()

    def flush(self) -> bool:
        """Sends queued rows in order until one fails; whether all were sent."""
        import reverb

        while self._unsent:
            writer = None
            if self._client is None:
                self._client = reverb.Client(self._address)
            try:
                writer = self._client.trajectory_writer(num_keep_alive_refs=1, validate_items=False)
                writer.append([self._unsent[0]])
                writer.create_item(ACTOR_ROWS_TABLE, 1.0, [writer.history[0][-1]])
                writer.end_episode(timeout_ms=self._timeout_ms)
            except (reverb.DeadlineExceededError, RuntimeError) as error:
                # The service is away (restarting, or gone): the row stays queued, and in the actor's CSV.
                log.debug("could not forward an episode row: %s", error)
                # A fresh client next time: a channel that saw its server go backs off for minutes.
                self._client = None
                return False
            finally:
                if writer is not None:
                    writer.close()
            self._unsent.popleft()
            self.sent += 1
        return True


class RowDrain:
    """The replay service's side: moves rows from the actor_rows table into actors/<actor_id>.csv under `actors_dir`."""

    def __init__(self, client: Any, actors_dir: Path, num_local_actors: int):
        self._client = client
        self._dir = Path(actors_dir)
        self._num_local = int(num_local_actors)
        self._loggers: Dict[int, Any] = {}
        self.rejected = 0

    def discard(self) -> None:
        """Empties the table: rows restored from a replay checkpoint were drained before the crash."""
        self._client.reset(ACTOR_ROWS_TABLE)

    def drain(self, timeout_s: int = 5) -> int:
        """Writes every row waiting in the table to its actor's CSV; how many were written."""
        size = int(self._client.server_info(timeout=timeout_s)[ACTOR_ROWS_TABLE].current_size)
        if size == 0:
            return 0
        # Only this drain removes rows, and an overflowing table drops one row per row added, so
        # `size` rows are there to read: the sampler cannot block.
        written = 0
        for sample in self._client.sample(ACTOR_ROWS_TABLE, num_samples=size, emit_timesteps=False):
            try:
                row = decode_row(sample.data[0])
                taken = check_remote_actor_id(row["actor_id"], self._num_local)
                if taken:
                    raise ValueError(taken)
            except ValueError as error:
                self.rejected += 1
                log.warning("dropped a remote actor's episode row (%d so far): %s", self.rejected, error)
                continue
            self._logger(row["actor_id"]).write(row)
            written += 1
        return written

    def close(self) -> None:
        """Flushes and closes the CSV files."""
        for logger in self._loggers.values():
            logger.close()
        self._loggers.clear()

    def _logger(self, actor_id: int) -> Any:
        from actorq_jax.telemetry import ACTOR_FIELDS, CsvLogger

        if actor_id not in self._loggers:
            # Flushed at once, as the actors' own files are: a killed service loses no drained row.
            self._loggers[actor_id] = CsvLogger(self._dir / f"actor_{actor_id}.csv", ACTOR_FIELDS, flush_every_s=0)
        return self._loggers[actor_id]


def check_remote_actor_id(actor_id: int, num_local_actors: int) -> Optional[str]:
    """Why `actor_id` cannot join a run of `num_local_actors` launcher actors, or None."""
    if actor_id < 0:
        return f"--actor_id must be >= 0, got {actor_id}"
    if actor_id < num_local_actors:
        return (f"--actor_id {actor_id} is one of the run's {num_local_actors} launcher actors "
                f"(ids 0-{num_local_actors - 1}); pick an id >= {num_local_actors}")
    return None
