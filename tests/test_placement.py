"""CPU placement: --learner_cpus / --actor_cpus parse, are checked against this machine, and pin a worker."""

import os
import subprocess
import sys

import pytest
from launch_support import ROOT

from actorq_jax.launch.config import RunConfig
from actorq_jax.launch.flags import parse_run
from actorq_jax.launch.runtime import cpu_list_problem, parse_cpu_list, role_cpus


@pytest.mark.parametrize("text, cores", [("0", (0,)), ("1,0", (0, 1)), ("0-2,5", (0, 1, 2, 5)), (" 3 ", (3,))])
def test_core_lists_parse(text, cores):
    assert parse_cpu_list(text) == cores


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "1,,2", "-1"])
def test_malformed_core_lists_are_rejected(text):
    with pytest.raises(ValueError, match="malformed core list"):
        parse_cpu_list(text)


def test_cores_this_process_cannot_use_are_named():
    absent = max(os.sched_getaffinity(0)) + 1
    assert str(absent) in cpu_list_problem(str(absent))
    assert cpu_list_problem(str(min(os.sched_getaffinity(0)))) is None


@pytest.mark.parametrize("flag", ["--learner_cpus", "--actor_cpus"])
def test_bad_core_flags_exit_2_naming_the_flag(flag, tmp_path, capsys):
    for value in ("x", str(max(os.sched_getaffinity(0)) + 1)):
        with pytest.raises(SystemExit) as exit_info:
            parse_run("d4pg", [flag, value, "--results_dir", str(tmp_path / "r")])
        assert exit_info.value.code == 2
        assert flag in capsys.readouterr().err


def test_roles_get_their_cores():
    first = min(os.sched_getaffinity(0))
    run = RunConfig(task="cartpole_balance", results_dir="r", learner_cpus=str(first), actor_cpus="")
    assert role_cpus("learner", run) == (first,)
    assert role_cpus("actor", run) == () and role_cpus("evaluator", run) == ()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_pinned_process_runs_only_on_its_cores():
    first = min(os.sched_getaffinity(0))
    code = ("import os; from actorq_jax.launch.config import RunConfig; from actorq_jax.launch import runtime; "
            f"run = RunConfig(task='t', results_dir='r', actor_cpus='{first}'); "
            "runtime.apply_cpu_affinity('actor', run); print(sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[{first}]"


def test_the_stop_flag_a_signal_handler_sets_takes_no_lock():
    """threading.Event.set() takes a lock, and a signal landing inside it (a second SIGTERM, or the main thread
    inside the same Event) waits forever for a lock its own thread holds: a learner hung that way after its
    launcher was killed (seen in a py-spy dump). The stop flag's setting side must hold no lock at all."""
    import signal
    import threading

    from actorq_jax.launch import runtime

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = runtime.install_stop_handlers()
        lock_types = (type(threading.Lock()), type(threading.RLock()), threading.Condition)
        assert not any(isinstance(value, lock_types) for value in vars(stop).values())
        assert stop.wait(0.01) is False and not stop.is_set()
        handler = signal.getsignal(signal.SIGTERM)
        handler(signal.SIGTERM, None)
        handler(signal.SIGTERM, None)  # re-entry is harmless
        assert stop.is_set() and stop.wait(0) is True
        # Set from another thread, a waiter wakes within its poll interval.
        later = runtime.StopFlag()
        threading.Timer(0.1, later.set).start()
        assert later.wait(30) is True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_cpu_meter_sums_a_workers_processes_and_skips_ended_ones():
    from types import SimpleNamespace

    from actorq_jax.launch.placement import CpuMeter, Placement

    class Process:
        def __init__(self, pid, exit_code=None):
            self.pid, self.returncode = pid, exit_code

        def poll(self):
            return self.returncode

    cpu = {101: 2.0, 102: 3.5, 103: 1.0}

    class Counting(Placement):
        def cpu_seconds(self, process):
            return cpu[process.pid]

    meter = CpuMeter(Counting(run=None, results_dir="."))
    learner = SimpleNamespace(name="learner", process=Process(101))
    actor = SimpleNamespace(name="actor_0", process=Process(102))
    meter.sample([learner, actor])
    cpu[101] = 4.0
    actor.process = Process(103)  # restarted: its first process's 3.5 s stay counted
    meter.sample([learner, actor, SimpleNamespace(name="evaluator", process=Process(104, exit_code=0))])
    assert meter.by_worker() == {"learner": 4.0, "actor_0": 4.5}
    assert CpuMeter(Placement(run=None, results_dir=".")).by_worker() == {}  # a backend that cannot tell: nothing
