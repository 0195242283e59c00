"""The layout of one run's results directory: every file and folder a run writes, named once.

    run = RunDir(results_dir)
    run.summary        # results_dir/summary.json
    run.actor_csv(3)   # results_dir/actors/actor_3.csv

The launcher, the workers, the analysis and the scripts reach a run's files only
through this class, so a rename happens here and nowhere else. It imports
nothing heavy: analysis code and flag parsing use it without JAX or Reverb.
"""

import contextlib
import errno
import fcntl
import json
import os
import time
from pathlib import Path
from typing import ClassVar, Iterator, List, Union

# The event a run's summary holds when a stop request (a signal), not a budget, ended it.
STOP_EVENT = "stop requested"
# How the launcher's event begins when a min_size run's replay table sat at --min_replay_size while the learner stepped.
NARROW_WINDOW_EVENT = "the replay table has held about"


class RunDir:
    """Paths inside one run's results directory (nothing is created or read here)."""

    # File names relative to the run's root, for code that moves files between runs or hosts.
    CONFIG: ClassVar[str] = "config.json"  # the run's flags and the agent's hyper-parameters
    SUMMARY: ClassVar[str] = "summary.json"  # totals, energy and returns, written when the run ends
    EMISSIONS: ClassVar[str] = "emissions.csv"  # codecarbon's energy record (a row per node under Ray)
    LEARNER_CSV: ClassVar[str] = "learner.csv"  # losses, rates and publication costs, a row per log period
    EVAL_CSV: ClassVar[str] = "eval.csv"  # the evaluator's returns, a row per policy and evaluation
    LOGS: ClassVar[str] = "logs"  # one log file per worker process
    STATUS: ClassVar[str] = "status"  # the control plane's reports of a local run, one JSON file per role
    ACTORS: ClassVar[str] = "actors"  # one episode CSV per actor id
    ACTOR_CSV_GLOB: ClassVar[str] = "actor_*.csv"
    CHECKPOINTS: ClassVar[str] = "checkpoints"  # the learner's Orbax checkpoints, with its counters
    REPLAY_CHECKPOINTS: ClassVar[str] = "replay_checkpoints"  # the replay service's Reverb checkpoints
    TENSORBOARD: ClassVar[str] = "tensorboard"  # TensorBoard event files, one folder per stream

    def __init__(self, root: Union[str, Path]):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunDir) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    @property
    def config(self) -> Path:
        """config.json."""
        return self.root / self.CONFIG

    @property
    def summary(self) -> Path:
        """summary.json."""
        return self.root / self.SUMMARY

    @property
    def emissions(self) -> Path:
        """emissions.csv."""
        return self.root / self.EMISSIONS

    @property
    def learner_csv(self) -> Path:
        """learner.csv."""
        return self.root / self.LEARNER_CSV

    @property
    def eval_csv(self) -> Path:
        """eval.csv."""
        return self.root / self.EVAL_CSV

    @property
    def logs(self) -> Path:
        """logs/."""
        return self.root / self.LOGS

    def log(self, worker: str) -> Path:
        """logs/<worker>.log: what one worker (learner, replay, actor_0, ...) wrote to stdout and stderr."""
        return self.logs / f"{worker}.log"

    @property
    def status(self) -> Path:
        """status/."""
        return self.root / self.STATUS

    def status_file(self, role: str) -> Path:
        """status/<role>.json: the latest report of the launcher, the replay service or the learner."""
        return self.status / f"{role}.json"

    @property
    def actors(self) -> Path:
        """actors/."""
        return self.root / self.ACTORS

    @staticmethod
    def actor_file(actor_id: int) -> str:
        """actor_<id>.csv: the name of one actor's episode CSV inside actors/."""
        return f"actor_{actor_id}.csv"

    def actor_csv(self, actor_id: int) -> Path:
        """actors/actor_<id>.csv: one actor's episodes."""
        return self.actors / self.actor_file(actor_id)

    def actor_csvs(self) -> List[Path]:
        """Every actor's episode CSV, sorted by name."""
        return sorted(self.actors.glob(self.ACTOR_CSV_GLOB))

    @property
    def checkpoints(self) -> Path:
        """checkpoints/."""
        return self.root / self.CHECKPOINTS

    @property
    def replay_checkpoints(self) -> Path:
        """replay_checkpoints/."""
        return self.root / self.REPLAY_CHECKPOINTS

    @property
    def tensorboard(self) -> Path:
        """tensorboard/: event files of the learner, the evaluator and each actor (one folder each)."""
        return self.root / self.TENSORBOARD


class ResultsDirInUse(RuntimeError):
    """Another launcher's run holds the results directory."""


# A launcher that has just ended may leave its last workers a moment to exit (they hold the claim it took).
CLAIM_WAIT_S = 5.0


@contextlib.contextmanager
def claimed(root: Union[str, Path], wait_s: float = CLAIM_WAIT_S) -> Iterator[None]:
    """Holds `root` for one launcher's run: ResultsDirInUse when another run's processes hold it past `wait_s`."""
    # An exclusive flock on the directory itself: nothing is left in it, and the kernel lets go when the last
    # process holding it ends, a SIGKILLed launcher included. Workers forked from the launcher hold it too,
    # so a resume also waits for a run whose launcher died before its workers did.
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    break  # a file system without flock (some network mounts): the run goes unguarded
                if time.monotonic() >= deadline:
                    raise ResultsDirInUse(_in_use(RunDir(root))) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)


def _in_use(run: RunDir) -> str:
    try:
        pid = json.loads(run.status_file("launcher").read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        pid = None
    who = f"its launcher, pid {pid}," if pid else "its launcher"
    return (f"{run.root} is in use: the run there is still going ({who} or one of its workers is alive); stop it "
            f"first (Ctrl-C or SIGTERM to its launcher), or pick another results directory")
