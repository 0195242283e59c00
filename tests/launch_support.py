"""Shared test settings (repository root, environment, tiny-run flags) and helpers of the tests that start real
runs (launcher, learner, actors) on the loopback."""

import atexit
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional

import psutil

from actorq_jax.agents.registry import get_agent
from actorq_jax.launch.placement import worker_env
from actorq_jax.launch.runtime import command_words
from actorq_jax.telemetry import read_csv

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"  # scripts, not a package: tests import them with this on sys.path
# One persistent XLA compilation cache for the test run and every process it starts: the suite's ~50 launcher
# runs compile the same tiny networks in each of their workers; with the cache, only the first compiles
# (about 20% less CPU and wall time per tiny run on 2 cores). The pytest process that makes it removes it at exit;
# pytest-xdist workers inherit its name through the environment and share it.
_CACHE_VAR = "ACTORQ_TEST_XLA_CACHE"
COMPILATION_CACHE = os.environ.get(_CACHE_VAR) or tempfile.mkdtemp(prefix="actorq-jax-test-xla-cache-")
if _CACHE_VAR not in os.environ:
    os.environ[_CACHE_VAR] = COMPILATION_CACHE
    atexit.register(shutil.rmtree, COMPILATION_CACHE, ignore_errors=True)
# Set for the whole test run (conftest.py) and for every process a test starts: no display, quiet TensorFlow,
# the compilation cache (every compile, however short: the tiny networks compile in well under JAX's 1 s default).
SHARED_ENV = {"MUJOCO_GL": "disable", "TF_CPP_MIN_LOG_LEVEL": "2", "JAX_COMPILATION_CACHE_DIR": COMPILATION_CACHE,
              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
ENV = worker_env(SHARED_ENV)
# Ray for tests: loopback only, token authentication on with a token of this test process (no file in $HOME
# needed). One token per process: Ray's client keeps the first token it reads, so every Ray test of a
# process must use the same one.
RAY_SETTINGS = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
# The registered agents' tiny runs (small enough for 2 cores; each agent's registry entry says what they are).
TINY = list(get_agent("d4pg").tiny)
TINY_DQN = list(get_agent("dqn").tiny)


def load_script(name: str) -> ModuleType:
    """experiments/<name>.py as a module (its main callable in-process; nothing runs at import)."""
    spec = importlib.util.spec_from_file_location(f"experiments_{name}", ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def usage_error(capsys: Any, call: Callable[[], Any]) -> str:
    """Runs `call`, which must exit with code 2 (argparse's usage error); returns what it wrote to stderr."""
    capsys.readouterr()
    try:
        call()
    except SystemExit as exit_info:
        err = capsys.readouterr().err
        assert exit_info.code == 2, f"exit code {exit_info.code}: {err[-2000:]}"
        return err
    raise AssertionError("accepted: no usage error")


def first_seen(predicates: Dict[str, Callable[[], Any]], since: float, timeout_s: float,
               proc: Optional[subprocess.Popen] = None) -> Dict[str, float]:
    """Seconds from `since` (a time.monotonic()) until each predicate first returned something truthy, all watched at
    once, so that one slow to come does not delay the time of another; AssertionError naming those unseen."""
    seen: Dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < len(predicates) and time.monotonic() < deadline:
        for name, predicate in predicates.items():
            if name not in seen and predicate():
                seen[name] = time.monotonic() - since
        if proc is not None and proc.poll() is not None and len(seen) < len(predicates):
            raise AssertionError(f"launcher exited (code {proc.returncode}) while waiting for "
                                 f"{sorted(set(predicates) - set(seen))}")
        time.sleep(0.25)
    unseen = sorted(set(predicates) - set(seen))
    assert not unseen, f"timed out after {timeout_s:.0f} s waiting for {unseen} (seen: {seen})"
    return seen


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, proc: Optional[subprocess.Popen] = None) -> Any:
    """Polls `predicate` until it returns something truthy; AssertionError naming `what` past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited (code {proc.returncode}) while waiting for {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def rows(path: Path) -> List[Dict[str, Any]]:
    """A CSV's rows, numbers parsed ([] before the file exists)."""
    try:
        return read_csv(path)
    except FileNotFoundError:
        return []


def status(results: Path, role: str = "learner") -> Dict[str, Any]:
    """A worker's last status report ({} before it wrote one)."""
    try:
        return json.loads((results / "status" / f"{role}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def start_run(results: Path, *flags: str, script: str = "experiments/run_d4pg.py") -> subprocess.Popen:
    """Starts a launcher (stdout and stderr merged, text)."""
    return subprocess.Popen([sys.executable, script, *flags, "--results_dir", str(results)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_remote_actor(address: str, log_dir: Path, *flags: str) -> subprocess.Popen:
    """Starts `python -m actorq_jax.launch.actor --server address` (stdout and stderr merged, text)."""
    return subprocess.Popen([sys.executable, "-m", "actorq_jax.launch.actor", "--server", address,
                             "--log_dir", str(log_dir), *flags],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def worker_process(launcher: psutil.Process, role: str, actor_id: Optional[int] = None,
                   restart: int = 0) -> Optional[psutil.Process]:
    """The launcher's child running `role` (and actor_id, restart), or None."""
    for child in launcher.children(recursive=True):
        try:
            cmd = command_words(child)
        except psutil.NoSuchProcess:
            continue
        if "actorq_jax.launch.worker" not in cmd or role not in cmd:
            continue
        if actor_id is not None and cmd[cmd.index("--actor_id") + 1] != str(actor_id):
            continue
        if (int(cmd[cmd.index("--restart") + 1]) if "--restart" in cmd else 0) == restart:
            return child
    return None


def alive(pids) -> List[int]:
    """The pids that still run (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def stop_all(*procs: Optional[subprocess.Popen]) -> None:
    """Kills whatever the test started that still runs."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
