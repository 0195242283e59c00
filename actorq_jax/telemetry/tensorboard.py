"""Live TensorBoard scalars of a run, written from its CSV streams by the launcher's process.

Every worker already writes its rows to the results directory (under Ray the
driver writes them), so one follower of those files serves both launchers and
costs the learner and the actors nothing. The events go to
`<results_dir>/tensorboard/<stream>/` (learner, eval, actor_<id>), so

    tensorboard --logdir results

shows every run under `results/` side by side, named by its directory.

The event files are written with TensorBoard's own record writer and protobufs,
which do not import TensorFlow: the launcher stays light.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from actorq_jax.run_dir import RunDir
from actorq_jax.telemetry.csv_logger import parse_field
from actorq_jax.telemetry.schema import ACTOR_PHASES

log = logging.getLogger(__name__)

EXPORT_PERIOD_S = 5.0


class EventWriter:
    """One TensorBoard event file in `logdir`, appended to with scalars."""

    def __init__(self, logdir: Path):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event_pb2 = event_pb2
        logdir.mkdir(parents=True, exist_ok=True)
        # TensorBoard's naming: it reads every file whose name holds "tfevents", newest last.
        name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
        self._records = RecordWriter(open(logdir / name, "wb"))
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def scalars(self, step: int, values: Mapping[str, float], wall_time: Optional[float] = None) -> None:
        """Writes each finite value as a scalar called by its key, at `step`."""
        from tensorboard.compat.proto import summary_pb2

        summary = summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items() if math.isfinite(v)])
        if summary.value:
            self._write(self._event_pb2.Event(wall_time=wall_time or time.time(), step=int(step), summary=summary))

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        """Hands what was written to the OS (TensorBoard sees it)."""
        self._records.flush()

    def close(self) -> None:
        """Flushes and closes the file."""
        self._records.close()


class CsvFollower:
    """The complete rows appended to a CSV file since the last call (numbers parsed)."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._header: Optional[List[str]] = None
        self._inode: Optional[int] = None
        self.rewritten = False  # whether the last call started over (its rows are the file's from the start)

    def new_rows(self) -> List[Dict[str, Any]]:
        """Rows finished since the last call; after the file was rewritten, its rows from the start."""
        self.rewritten = False
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return []
        size = stat.st_size
        # Rewritten: a learner or evaluator restored from a checkpoint drops the rows past it into a new file
        # (run_rows.drop_rows_after), which may have grown past our offset again by the time we look.
        self.rewritten = self._inode is not None and (stat.st_ino != self._inode or size < self._offset)
        if self.rewritten:
            self._offset, self._header = 0, None
        self._inode = stat.st_ino
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        end = data.rfind(b"\n")
        if end < 0:
            return []  # no complete line yet
        self._offset += end + 1
        lines = list(csv.reader(data[: end + 1].decode("utf-8", errors="replace").splitlines()))
        if self._header is None and lines:
            self._header, lines = lines[0], lines[1:]
        return [{k: parse_field(v) for k, v in zip(self._header or [], line)} for line in lines if line]


def _numbers(row: Mapping[str, Any], skip: Tuple[str, ...] = ()) -> Dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in skip}


def learner_scalars(row: Mapping[str, Any]) -> Tuple[int, Dict[str, float]]:
    """(learner step, scalars) of a learner.csv row: its losses, SGD steps/s and publication costs."""
    return int(row["learner_steps"]), {f"learner/{k}": v for k, v in _numbers(row, ("learner_steps",)).items()}


def eval_scalars(row: Mapping[str, Any]) -> Tuple[int, Dict[str, float]]:
    """(learner step, scalars) of an eval.csv row: the episode's return under its policy (fp32 or the actors')."""
    return int(row["learner_steps"]), {f"eval/return_{row['policy']}": float(row["return"]),
                                       "eval/env_steps": float(row["env_steps"])}


def actor_scalars(row: Mapping[str, Any]) -> Tuple[int, Dict[str, float]]:
    """(the actor's env steps, scalars) of an actor episode row: return, env steps/s and ms per env step by phase."""
    length = max(float(row.get("episode_length") or 0.0), 1.0)
    phases = {p: float(row.get(f"{p}_s") or 0.0) for p in ACTOR_PHASES}
    busy = sum(phases.values())
    values = {"actor/episode_return": float(row["episode_return"]),
              "actor/env_steps_per_s": length / busy if busy > 0 else math.nan}
    values.update({f"actor_ms_per_step/{p}": 1000.0 * s / length for p, s in phases.items()})
    return int(row["env_steps"]), values


class RunScalars:
    """Follows a run's learner.csv, eval.csv and actors/*.csv and writes their rows as TensorBoard scalars."""

    def __init__(self, results_dir: Path):
        self.dir = RunDir(results_dir)
        self._streams: Dict[Path, Tuple[CsvFollower, Any, str]] = {}
        self._writers: Dict[str, EventWriter] = {}

    def _follow(self) -> None:
        wanted = [(self.dir.learner_csv, learner_scalars, "learner"), (self.dir.eval_csv, eval_scalars, "eval")]
        wanted += [(path, actor_scalars, path.stem) for path in self.dir.actor_csvs()]
        for path, to_scalars, stream in wanted:
            if path not in self._streams:
                self._streams[path] = (CsvFollower(path), to_scalars, stream)

    def poll(self) -> int:
        """Writes the rows finished since the last poll; how many."""
        self._follow()
        written = 0
        for follower, to_scalars, stream in self._streams.values():
            rows = follower.new_rows()
            if not rows:
                continue
            writer = self._writers.get(stream)
            if writer is None:
                writer = self._writers[stream] = EventWriter(self.dir.tensorboard / stream)
            for row in rows:
                try:
                    step, values = to_scalars(row)
                except (KeyError, TypeError, ValueError) as error:  # a row cut by a killed writer
                    log.debug("skipped a %s row: %s", stream, error)
                    continue
                writer.scalars(step, values)
                written += 1
            writer.flush()
        return written

    def close(self) -> None:
        """Closes every event file."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


class TensorBoardExport:
    """A thread that polls a run's RunScalars every `period_s` until close(), which polls a last time."""

    def __init__(self, results_dir: Path, period_s: float = EXPORT_PERIOD_S):
        # The writer's modules are imported here, on the caller's thread: imported first by the export thread
        # while the caller imports Reverb (TensorFlow, which imports TensorBoard too), the two imports meet
        # half-initialised modules and one of them fails.
        import tensorboard.compat.proto.event_pb2  # noqa: F401
        import tensorboard.compat.proto.summary_pb2  # noqa: F401
        import tensorboard.summary.writer.record_writer  # noqa: F401

        self.scalars = RunScalars(results_dir)
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tensorboard", daemon=True)

    def start(self) -> "TensorBoardExport":
        """Starts following the run."""
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._period_s):
            self._poll()

    def _poll(self) -> None:
        try:
            self.scalars.poll()
        except OSError as error:  # a full disk must not stop the run: the CSVs hold everything
            log.warning("TensorBoard export failed: %s", error)

    def close(self) -> None:
        """Stops the thread, writes what is left and closes the files."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._poll()
        self.scalars.close()
