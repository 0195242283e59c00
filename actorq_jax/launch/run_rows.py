"""learner.csv and eval.csv rows carried to the launcher's process under `--launcher ray`.

Under Ray the learner and the evaluator run on nodes that share no disk with the
launcher. Each still writes its CSV on its node, and sends every row through
the run's replay service (`RowSender`, into RUN_ROWS_TABLE as a JSON message:
the file, its columns, the row). The launcher's process, which owns the real
results directory, drains that table (`RunRowDrain`) and appends each row to
its file. A learner restored from a checkpoint logs steps again: the drain then
drops the rows past the restored step first, as a local learner trims its own
file (`drop_rows_after`). Its evaluations start again from the restored step too:
an evaluation behind the newest one written drops those from its step on, in the
evaluator's own file (`EvaluationLog`) and in the drain alike, so eval.csv follows
the learner's surviving timeline as learner.csv does. Actors' rows take the road
of launch/actor_rows.py, which writes each exactly once.
"""

import collections
import csv
import logging
import math
import os
from pathlib import Path
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence

from actorq_jax.run_dir import RunDir

log = logging.getLogger(__name__)

RUN_ROWS_TABLE = "run_rows"
# The files rows may name (anything else is refused), relative to the results directory.
ROW_FILES = (RunDir.LEARNER_CSV, RunDir.EVAL_CSV)
MAX_PENDING_ROWS = 10_000
SEND_TIMEOUT_S = 5.0


def make_run_rows_table() -> Any:
    """The FIFO table the learner's and evaluator's rows wait in until the launcher's process writes them."""
    from actorq_jax.replay.messages import make_message_table

    return make_message_table(RUN_ROWS_TABLE, max_size=MAX_PENDING_ROWS)


def drop_rows_after(path: Path, step: int) -> None:
    """Removes learner.csv rows past `step`: after a restore they belong to a timeline that was lost."""
    if not path.exists():
        return
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or "learner_steps" not in rows[0]:
        return
    column = rows[0].index("learner_steps")
    kept = [rows[0]] + [r for r in rows[1:] if len(r) > column and r[column].isdigit() and int(r[column]) <= step]
    if len(kept) == len(rows):
        return
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        csv.writer(f).writerows(kept)
    os.replace(tmp, path)


class RowSender:
    """Sends one file's rows to the replay service at `address`; rows it could not send wait for the next call."""

    def __init__(self, address: str, file: str, fields: Sequence[str]):
        if file not in ROW_FILES:
            raise ValueError(f"rows of {file!r} are not carried; files: {ROW_FILES}")
        self._address, self._file, self._fields = address, file, list(fields)
        self._client: Any = None
        self._outbox: Deque[Dict[str, Any]] = collections.deque(maxlen=MAX_PENDING_ROWS)

    def send(self, row: Mapping[str, Any]) -> None:
        """Queues `row` and sends what waits."""
        self._outbox.append({"file": self._file, "fields": self._fields, "row": dict(row)})
        self.flush()

    def flush(self) -> bool:
        """Sends the waiting rows in order until one fails; whether every row was sent."""
        import reverb

        from actorq_jax.replay.messages import send_message

        try:
            while self._outbox:
                if self._client is None:
                    self._client = reverb.Client(self._address)
                send_message(self._client, RUN_ROWS_TABLE, self._outbox[0], SEND_TIMEOUT_S)
                self._outbox.popleft()
        except (reverb.DeadlineExceededError, RuntimeError) as error:
            log.debug("could not send a %s row: %s", self._file, error)
            self._client = None  # a fresh channel next time (one that saw its server go backs off)
            return False
        return True


class ForwardedCsv:
    """A CsvLogger whose rows are also sent to the launcher's process (write, flush, close, a context manager)."""

    def __init__(self, logger: Any, sender: RowSender):
        self.logger, self.sender = logger, sender

    def write(self, row: Mapping[str, Any]) -> None:
        """Writes `row` here and sends it."""
        self.logger.write(row)
        self.sender.send(row)

    def flush(self) -> None:
        """Flushes the file and sends what waits."""
        self.logger.flush()
        self.sender.flush()

    def close(self) -> None:
        """Closes the file; sends what waits (once more)."""
        self.logger.close()
        if not self.sender.flush():
            log.warning("some rows did not reach the launcher's results directory")

    def __enter__(self) -> "ForwardedCsv":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def row_log(path: Path, fields: Sequence[str], forward_to: Optional[str] = None, flush_every_s: float = 2.0) -> Any:
    """A CsvLogger for `path`; with `forward_to` (the service's address, under Ray) its rows are sent there too."""
    from actorq_jax.telemetry.csv_logger import open_run_csv

    logger = open_run_csv(path, fields, flush_every_s=flush_every_s)
    return logger if forward_to is None else ForwardedCsv(logger, RowSender(forward_to, Path(path).name, fields))


def newest_step(path: Path) -> int:
    """The highest learner_steps among a CSV's rows (-1: none)."""
    steps = (r.get("learner_steps") for r in _read_rows(path))
    return max((int(s) for s in steps if isinstance(s, (int, float)) and math.isfinite(s)), default=-1)


class EvaluationLog:
    """eval.csv as the evaluator writes it (a row_log): an evaluation behind the newest one written comes from a
    learner restored from an older checkpoint, so the rows from its step on, a lost timeline's, go first."""

    def __init__(self, path: Path, fields: Sequence[str], forward_to: Optional[str] = None):
        self.path, self.fields, self.forward_to = Path(path), list(fields), forward_to
        self.newest = newest_step(self.path)
        self.logger = row_log(self.path, self.fields, forward_to)

    def write(self, row: Mapping[str, Any]) -> None:
        """Appends `row` (after dropping the rows it replaces)."""
        step = int(row["learner_steps"])
        if step < self.newest:
            self._drop_from(step)
        self.newest = step
        self.logger.write(row)

    def evaluated(self, policies: Sequence[str], episodes: int) -> Optional[int]:
        """The newest step the file holds a whole evaluation of (every policy's episodes), else None.

        A restarted evaluator, or a resumed run's, skips that version rather than write its rows twice. Rows of
        an evaluation cut short at that step (its evaluator killed) are dropped, so that it is made again whole.
        """
        if self.newest < 0:
            return None
        self.logger.flush()
        # A final evaluation counts: a resumed learner publishes the final checkpoint's step, the same weights.
        done = {(r.get("policy"), r.get("episode")) for r in _read_rows(self.path) if r.get("learner_steps") == self.newest}
        if done >= {(policy, episode) for policy in policies for episode in range(episodes)}:
            return self.newest
        self._drop_from(self.newest)
        self.newest = newest_step(self.path)
        return None

    def _drop_from(self, step: int) -> None:
        self.logger.close()
        drop_rows_after(self.path, step - 1)
        self.logger = row_log(self.path, self.fields, self.forward_to)

    def flush(self) -> None:
        """Flushes the file (and sends what waits)."""
        self.logger.flush()

    def close(self) -> None:
        """Closes the file (and sends what waits)."""
        self.logger.close()

    def __enter__(self) -> "EvaluationLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class RunRowDrain:
    """The launcher's side: appends the rows waiting in RUN_ROWS_TABLE to their files under `results_dir`."""

    def __init__(self, client: Any, results_dir: Path):
        self._client = client
        self._dir = Path(results_dir)
        self._loggers: Dict[str, Any] = {}
        self._newest: Dict[str, int] = {}  # per file, the learner step of the last row written
        self.rejected = 0

    def drain(self, timeout_s: int = 5) -> int:
        """Writes every waiting row; how many."""
        from actorq_jax.replay.messages import take_messages

        written = 0
        for message in self._take(take_messages, timeout_s):
            file, fields, row = message.get("file"), message.get("fields"), message.get("row")
            if (file not in ROW_FILES or not isinstance(row, dict) or not isinstance(fields, list)
                    or not set(row) <= set(fields)):
                self.rejected += 1
                log.warning("dropped a malformed %s row (%d so far)", file, self.rejected)
                continue
            self._continue(file, int(row.get("learner_steps", 0)))
            self._logger(file, fields).write(row)
            written += 1
        return written

    def _take(self, take: Any, timeout_s: int) -> List[Dict[str, Any]]:
        try:
            return take(self._client, RUN_ROWS_TABLE, timeout_s)
        except ValueError as error:  # one undecodable message: the others went with it
            self.rejected += 1
            log.warning("dropped undecodable rows: %s", error)
            return []

    def _continue(self, file: str, step: int) -> None:
        """Before a row of `file` at `step`: a learner row not past the newest, or an evaluation behind it, means a
        restored learner, so the rows from `step` on (a lost timeline's) go first (EvaluationLog)."""
        path = self._dir / file
        newest = self._newest.get(file)
        if newest is None:
            newest = newest_step(path)
        if step < newest or (file == RunDir.LEARNER_CSV and step == newest):
            logger = self._loggers.pop(file, None)
            if logger is not None:
                logger.close()
            drop_rows_after(path, step - 1)
        self._newest[file] = step

    def _logger(self, file: str, fields: List[str]) -> Any:
        from actorq_jax.telemetry.csv_logger import open_run_csv

        if file not in self._loggers:
            self._loggers[file] = open_run_csv(self._dir / file, fields, flush_every_s=0)
        return self._loggers[file]

    def close(self) -> None:
        """Closes the files."""
        for logger in self._loggers.values():
            logger.close()
        self._loggers.clear()


def _read_rows(path: Path) -> List[Dict[str, Any]]:
    from actorq_jax.telemetry import read_csv

    try:
        return read_csv(path)
    except (FileNotFoundError, ValueError):
        return []
