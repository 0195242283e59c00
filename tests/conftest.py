"""Settings every test shares, and the tiers of the suite.

The repository root, the environment of the test run and the tiny-run flag presets are defined once, in
launch_support.py. Tests that start a subprocess, a Reverb server, a Ray cluster or a launcher carry the
`process` marker; `pytest -m "not process"` (the unit tier) refuses to start any of those, so a test
missing its marker fails there instead of slowing the tier down.

With pytest-xdist workers (`ACTORQ_TEST_WORKERS=N ./scripts/test.sh`), modules that hold a costly
module-scoped fixture (a sweep, a Ray cluster) keep their tests on one worker with an `xdist_group` mark,
and modules with `slow` tests are collected first, so that no long test starts last while others idle.
"""

import faulthandler
import multiprocessing.process
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, List

import pytest
from launch_support import RAY_SETTINGS, SHARED_ENV

# Where a SIGTERM that ends a test process writes its stacks: a copy of stderr made before pytest captures fd 2
# per test (what it captured is lost with the process). Kept open for the process's life.
_SIGNAL_REPORT = None


def pytest_configure(config: pytest.Config) -> None:
    """Sets the shared environment for the whole test run, before any test module is imported."""
    global _SIGNAL_REPORT
    # A pytest-xdist worker ended by a signal is reported as "node down: Not properly terminated" and nothing
    # else; its threads' stacks at the SIGTERM say what it was doing (SIGKILL leaves no trace at all).
    _SIGNAL_REPORT = os.fdopen(os.dup(2), "w")
    faulthandler.register(signal.SIGTERM, file=_SIGNAL_REPORT, all_threads=True, chain=True)
    # Not in children forked by a test (multiprocessing's), which tests end with SIGTERM on purpose.
    os.register_at_fork(after_in_child=lambda: faulthandler.unregister(signal.SIGTERM))
    os.environ.update(SHARED_ENV)
    # Ray's client keeps the auth mode and token it first reads: whichever test imports Ray first must
    # already see the ones every Ray instance of this test process is started with.
    os.environ.update(RAY_SETTINGS)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Modules with `slow` tests first, then those with `process` tests, then the rest (each module's order kept)."""
    rank = {}
    for item in items:
        mark = 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("process") else 2
        rank[item.module.__name__] = min(rank.get(item.module.__name__, 2), mark)
    items.sort(key=lambda item: rank[item.module.__name__])


def pytest_xdist_node_collection_finished(node: Any, ids: List[str]) -> None:
    """Under --dist loadgroup, stops the run if a module marked with xdist_group reached the scheduler ungrouped."""
    if node.config.getoption("dist", "no") != "loadgroup":
        return
    grouped = {path.name for path in Path(__file__).parent.glob("test_*.py") if "xdist_group(" in path.read_text()}
    for nodeid in ids:
        if Path(nodeid.split("::", 1)[0]).name in grouped and "@" not in nodeid:
            # Without its group, a module's costly shared fixture (a Ray cluster, a sweep) is built on every worker
            # at once: twice the work, and two Ray clusters on one machine.
            pytest.exit(f"pytest-xdist did not group {nodeid} (xdist_group has no effect with pytest "
                        f"{pytest.__version__}); install the pytest pinned in requirements.txt", returncode=4)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    """In a pytest-xdist worker, writes every thread's stack to the run's stderr 3 s before the test's timeout.

    pytest-timeout ends a worker whose test runs past its limit with os._exit, and writes its own dump where a
    worker's output is lost: the run shows only "node down: Not properly terminated".
    """
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 0)
    armed = bool(os.environ.get("PYTEST_XDIST_WORKER")) and _SIGNAL_REPORT is not None and limit > 3
    if armed:
        faulthandler.dump_traceback_later(limit - 3, exit=False, file=_SIGNAL_REPORT)
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


def _unit_tier(config: pytest.Config) -> bool:
    return "not process" in (config.getoption("markexpr") or "")


def _refuse(what: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a test outside the `process` marker started {what}; mark it @pytest.mark.process")
    return refused


# Hardware probes that libraries run on first use (numpy.testing runs lscpu when imported): not the test's processes.
_LIBRARY_PROBES = {"lscpu", "uname", "nvidia-smi", "rocm-smi"}
_popen_init = subprocess.Popen.__init__


def _program(args: Any) -> str:
    first = args.split()[0] if isinstance(args, str) and args.split() else (list(args)[0] if args else "")
    return os.path.basename(os.fspath(first))


def _probes_only(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
    if _program(args) not in _LIBRARY_PROBES:
        _refuse(f"a subprocess ({_program(args)})")()
    _popen_init(self, args, *rest, **kwargs)


@pytest.fixture(autouse=True)
def _no_processes_in_the_unit_tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the unit tier, starting a subprocess, a multiprocessing child or a Reverb server fails the test."""
    if _unit_tier(request.config) and request.node.get_closest_marker("process") is None:
        monkeypatch.setattr(subprocess.Popen, "__init__", _probes_only)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("a multiprocessing child"))
        if "reverb" in sys.modules:
            monkeypatch.setattr(sys.modules["reverb"].Server, "__init__", _refuse("a Reverb server"))
