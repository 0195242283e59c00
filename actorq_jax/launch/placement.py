"""Where the launcher's worker processes run: one interface, two backends.

The launcher decides *what* runs (a replay service, a learner, N actors, an evaluator), watches
them, restarts them and stops them in order; a placement decides *where* and
*how* one worker process is started, polled, signalled and killed, where its
files go, and how energy is measured. `LocalPlacement` starts subprocesses on
this machine writing straight into the results directory (forked from a template
process that imported the workers' libraries once, see `WorkerForker`); `RayPlacement`
(launch/ray_placement.py) starts the same worker command inside Ray actors on
a cluster's nodes and brings what they send (rows, checkpoints, logs) into the
results directory. The launcher picks one (`launcher.make_placement`).

A started worker is a `WorkerProcess`: the subset of `subprocess.Popen` the
launcher uses (pid, returncode, poll, wait, send_signal, kill), so the watch,
restart and shutdown logic reads the same under every backend. A Ray worker
whose host was lost (its node left) has no exit code: its `lost` says why, and
`ended`/`how_it_ended` read both kinds of ending.
"""

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Tuple

from actorq_jax.run_dir import RunDir

WORKER_MODULE = "actorq_jax.launch.worker"
LAUNCHERS = ("local", "ray")
# What the workers of every role import. A fresh worker process spends 5-7 CPU-seconds importing them (Reverb
# alone brings TensorFlow), more than a short run's workers spend working; the template process imports them
# once per run and each worker is forked from it. Importing them computes nothing: no JAX backend, no
# TensorFlow runtime and no Reverb connection exists in the template, so the fork copies no threads or sockets.
WORKER_PRELOAD = ("actorq_jax.launch.worker", "jax", "jax.numpy", "numpy", "reverb", "dm_control.suite", "flax.linen",
                  "actorq_jax.agents.registry", "actorq_jax.launch.replay_service", "actorq_jax.launch.learner",
                  "actorq_jax.launch.actor", "actorq_jax.launch.evaluator", "optax", "rlax", "orbax.checkpoint")


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


class ForkedWorker:
    """A worker forked from the template process (multiprocessing's forkserver), seen as a subprocess.Popen."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> Optional[int]:
        """The exit code (minus the signal's number when a signal ended it), None while it runs."""
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        """The exit code, or None while it runs."""
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Waits for the exit code; subprocess.TimeoutExpired past `timeout`."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        """Sends a signal (nothing once it has exited)."""
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """Kills it at once."""
        self.send_signal(signal.SIGKILL)


class WorkerForker:
    """Starts worker processes by forking a template that imported WORKER_PRELOAD (one per launcher process).

    multiprocessing's forkserver is that template: a fresh interpreter started on the first worker's start,
    which exits when the launcher does (its workers then get SIGTERM, runtime.die_with_parent). A worker's
    parent is therefore the template, not the launcher.
    """

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(WORKER_PRELOAD))

    def start(self, command: List[str], log_path: Path, env: Dict[str, str]) -> ForkedWorker:
        """Forks `python -m actorq_jax.launch.worker ...` (command) with `env`, its output appended to log_path."""
        from actorq_jax.launch.worker import forked_main

        # The template starts with this process's environment and reads some of it while importing (TensorFlow's
        # log level, MuJoCo's renderer): those must already be the workers'.
        for key in ("MUJOCO_GL", "TF_CPP_MIN_LOG_LEVEL"):
            os.environ[key] = env[key]
        argv = command[command.index(WORKER_MODULE) + 1:]
        # Daemonic: should the launcher end abnormally, multiprocessing terminates its workers at its exit.
        process = self._context.Process(target=forked_main, args=(argv, str(log_path), env, " ".join(command)),
                                        name=argv[0], daemon=True)
        process.start()
        return ForkedWorker(process)


_FORKER: Optional[WorkerForker] = None


def worker_forker() -> WorkerForker:
    """This process's WorkerForker (its template starts with the first worker and serves every later one)."""
    global _FORKER
    if _FORKER is None:
        _FORKER = WorkerForker()
    return _FORKER


class LocalPlacement(Placement):
    """Workers are processes on this machine (forked from the template), writing into the results directory."""

    name = "local"

    def start(self, name: str, role: str, args: List[str]) -> WorkerProcess:
        """Starts `python -m actorq_jax.launch.worker ROLE ...` here, its output appended to logs/<name>.log."""
        # --parent_pid 0: the worker's parent is the template, which lives exactly as long as this launcher.
        command = worker_command(role, 0, self.results_dir, args)
        return worker_forker().start(command, RunDir(self.results_dir).log(name), worker_env())

    def service_address(self, port: int) -> str:
        """Local workers reach the replay service on localhost at the run's port."""
        return f"localhost:{port}"

    def cpu_seconds(self, process: WorkerProcess) -> Optional[float]:
        """The subprocess's CPU seconds from /proc (None once it has exited)."""
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
    return str(lost) if lost else f"exit code {process.returncode}"
