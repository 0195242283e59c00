"""Where the launcher's worker processes run: one interface, two backends.

The launcher decides *what* runs (a replay service, a learner, N actors, an evaluator), watches
them, restarts them and stops them in order; a placement decides *where* and
*how* one worker process is started, polled, signalled and killed, where its
files go, and how energy is measured. `LocalPlacement` starts subprocesses on
this machine writing straight into the results directory (forked from a template
process that imported the workers' libraries once: launch/forker.py); `RayPlacement`
(launch/ray_placement.py) starts the same worker command inside Ray actors on
a cluster's nodes and brings what they send (rows, checkpoints, logs) into the
results directory. The launcher picks one (`launcher.make_placement`).

A started worker is a `WorkerProcess`: the subset of `subprocess.Popen` the
launcher uses (pid, returncode, poll, wait, send_signal, kill), so the watch,
restart and shutdown logic reads the same under every backend. A Ray worker
whose host was lost (its node left) has no exit code: its `lost` says why, and
`ended`/`how_it_ended` read both kinds of ending.
"""

import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Tuple

from actorq_jax.launch import runtime
from actorq_jax.net import LOOPBACK
from actorq_jax.run_dir import RunDir

WORKER_MODULE = "actorq_jax.launch.worker"


class WorkerProcess(Protocol):
    """A started worker process, wherever it runs (the part of subprocess.Popen the launcher uses)."""

    pid: int
    returncode: Optional[int]

    def poll(self) -> Optional[int]:
        """The exit code, or None while it runs."""

    def wait(self, timeout: Optional[float] = None) -> int:
        """Waits for the exit code; subprocess.TimeoutExpired past `timeout`."""

    def send_signal(self, sig: int) -> None:
        """Sends a signal (SIGTERM asks for an orderly stop)."""

    def kill(self) -> None:
        """Kills it at once."""


class EnergyMeter(Protocol):
    """Energy measured over a run: start(), then stop() -> {energy_kwh, emissions_kg, duration_s}."""

    def start(self) -> None:
        """Starts measuring."""

    def stop(self) -> Dict[str, float]:
        """Stops measuring and returns the figures (NaN where unmeasured)."""


def worker_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of a worker process: this one's, headless physics, quiet TensorFlow."""
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "disable"), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.update(extra or {})
    return env


def worker_command(role: str, parent_pid: int, results_dir: Path, args: List[str]) -> List[str]:
    """`python -m actorq_jax.launch.worker ROLE ...` for a worker whose parent is `parent_pid`."""
    return [sys.executable, "-m", WORKER_MODULE, role, "--parent_pid", str(parent_pid),
            "--results_dir", str(results_dir), *args]


class Placement:
    """How the launcher's workers are placed; the base class is the local one (subprocesses of this process)."""

    name = "local"

    def __init__(self, run: Any, results_dir: Path):
        self.run = run
        self.results_dir = Path(results_dir)
        self.events: List[str] = []  # where workers landed, hosts lost: the launcher adds them to the summary

    def open(self) -> None:
        """Prepares the backend (nothing for local subprocesses)."""

    def start(self, name: str, role: str, args: List[str]) -> WorkerProcess:
        """Starts worker `name` (role replay/learner/actor/evaluator) with worker flags `args`; logs to logs/<name>.log."""
        raise NotImplementedError

    def service_address(self, port: int) -> str:
        """HOST:PORT at which the run's processes reach the replay service (started already) on `port`."""
        raise NotImplementedError

    def energy_meter(self, country: str) -> EnergyMeter:
        """What measures the run's energy (writes emissions.csv into the results directory)."""
        from actorq_jax.telemetry import EnergyTracker

        # Machine mode: per-process tracking would miss the other processes of the run.
        return EnergyTracker(self.results_dir, country_iso_code=country, tracking_mode="machine")

    def cpu_seconds(self, process: WorkerProcess) -> Optional[float]:
        """CPU seconds (user + system) a running worker has used so far; None where this backend cannot tell."""
        return None

    def collect(self) -> None:
        """Writes what workers sent through the replay service (rows, checkpoints) into the results directory now,
        while the service is still up (nothing to do locally: workers write there themselves)."""

    def close(self) -> None:
        """Releases the backend once every worker has exited; the results directory is complete after it."""


class LocalPlacement(Placement):
    """Workers are child processes of the launcher on this machine, writing into the results directory."""

    name = "local"

    def __init__(self, run: Any, results_dir: Path):
        super().__init__(run, results_dir)
        from actorq_jax.launch.forker import WorkerForker

        self.forker = WorkerForker(RunDir(self.results_dir).log("template"), worker_env())

    def open(self) -> None:
        """Starts the workers' template now, while this process has one thread and may be its image (forker.py)."""
        self.forker.ensure_running()

    def start(self, name: str, role: str, args: List[str]) -> WorkerProcess:
        """Starts `python -m actorq_jax.launch.worker ROLE ...` here, its output appended to logs/<name>.log."""
        command = worker_command(role, os.getpid(), self.results_dir, args)
        return self.forker.start(command, RunDir(self.results_dir).log(name), worker_env())

    def service_address(self, port: int) -> str:
        """Local workers reach the replay service on the loopback at the run's port."""
        return f"{LOOPBACK}:{port}"

    def close(self) -> None:
        """Stops the template that forked the workers."""
        self.forker.close()

    def cpu_seconds(self, process: WorkerProcess) -> Optional[float]:
        """The worker's CPU seconds from /proc (None once it has exited)."""
        import psutil

        try:
            times = psutil.Process(process.pid).cpu_times()
        except psutil.Error:
            return None
        return times.user + times.system


class CpuMeter:
    """CPU seconds of each worker of a run, summed over its processes (restarts included).

    Sampled while the workers run (the launcher samples every quarter second and before it signals a
    worker to stop), so up to one sampling period at the end of each process is missed. It shows where
    a run's CPU went (the replay service's share, for instance), which the per-phase timers cannot.
    """

    def __init__(self, placement: Placement):
        self.placement = placement
        self._last: Dict[Tuple[str, int], float] = {}

    def sample(self, workers: List[Any]) -> None:
        """Records each running worker's CPU so far (workers: objects with .name and .process)."""
        for worker in workers:
            if worker.process is None or ended(worker.process):
                continue
            seconds = self.placement.cpu_seconds(worker.process)
            if seconds is not None:
                self._last[(worker.name, worker.process.pid)] = seconds

    def by_worker(self) -> Dict[str, float]:
        """CPU seconds per worker name (every process that ran under that name); empty where the backend cannot tell."""
        totals: Dict[str, float] = {}
        for (name, _), seconds in self._last.items():
            totals[name] = totals.get(name, 0.0) + seconds
        return totals


def ended(process: WorkerProcess) -> bool:
    """Whether a worker is over: it exited, or (under Ray) its host was lost with its node."""
    return process.poll() is not None or bool(getattr(process, "lost", None))


def how_it_ended(process: WorkerProcess) -> str:
    """How a worker that is over ended: 'exit code N', or why its host was lost."""
    lost = getattr(process, "lost", None)
    if lost:
        return str(lost)
    if process.returncode == runtime.EXIT_HUNG:
        return f"exit code {process.returncode}: its main loop hung for --actor_hang_s"
    return f"exit code {process.returncode}"
