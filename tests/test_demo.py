"""experiments/demo.py: what its closing lines say about two runs (hand-made figures), and its flag checks."""

import math

import pytest
from launch_support import load_script, usage_error

demo = load_script("demo")


def _figures(seconds: float, env_steps: float, rate: float = 1000.0) -> dict:
    reached = seconds == seconds
    return {"reached": reached, "time_to_target_s": seconds, "env_steps_to_target": env_steps if reached else math.nan,
            "env_steps_per_s": rate, "bound_by": "CPU on the actors' cores"}


def test_the_time_ratio_is_split_into_stepping_speed_and_env_steps_needed():
    text = demo._explain(_figures(210.0, 376_000.0, 1700.0), _figures(240.0, 404_000.0, 1770.0))
    assert "time to 900: q=32 210 s, q=8 240 s: q=8 0.88x as fast" in text
    assert "env steps/s q=8 / q=32: 1.04x" in text
    # 404,000 / 240 over 376,000 / 210 = 0.94; 404,000 / 376,000 = 1.07; their ratio is the 0.88 above.
    assert "up to 900, q=8 stepped 0.94x as fast and needed 1.07x the env steps of q=32 (404,000 vs 376,000)" in text


def test_a_run_that_missed_the_target_gives_no_ratio():
    text = demo._explain(_figures(210.0, 376_000.0), _figures(math.nan, math.nan))
    assert "q=8 not reached: no ratio (a run did not reach it)" in text
    assert "stepped" not in text


@pytest.mark.parametrize("seconds", ["0", "-5"])
def test_a_budget_that_is_not_positive_is_refused_by_name(capsys, seconds):
    assert f"--seconds_per_run must be > 0, got {float(seconds)}" in usage_error(
        capsys, lambda: demo.main(["--seconds_per_run", seconds]))


def test_a_results_dir_that_cannot_hold_both_runs_is_refused_before_either_starts(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert f"--results_dir: {blocker / 'demo'} cannot be created: {blocker} is a file" in usage_error(
        capsys, lambda: demo.main(["--results_dir", str(blocker / "demo")]))
    earlier = tmp_path / "demo" / "d4pg_cartpole_balance_q8_s0"
    earlier.mkdir(parents=True)
    (earlier / "config.json").write_text("{}")
    assert f"--results_dir: {tmp_path / 'demo'} already holds a demo run ({earlier})" in usage_error(
        capsys, lambda: demo.main(["--results_dir", str(tmp_path / "demo")]))
    assert not (tmp_path / "demo" / "d4pg_cartpole_balance_q32_s0").exists()  # the q=32 run never started


# A stand-in for the launcher: on SIGINT it finishes its shutdown (half a second) and says so, then exits 0.
# It speaks on stderr, as the launcher's progress line does (the demo sends a run's stdout to /dev/null).
_LAUNCHER = """
import signal, sys, time
stop = []
signal.signal(signal.SIGINT, lambda *_: stop.append(1))
print("ready", file=sys.stderr, flush=True)
while not stop:
    time.sleep(0.01)
time.sleep(0.5)
print("final checkpoint written", file=sys.stderr, flush=True)
"""


@pytest.mark.process
@pytest.mark.timeout(60)
def test_ctrl_c_lets_the_run_finish_its_shutdown_and_says_interrupted():
    import os
    import signal
    import subprocess
    import sys

    from launch_support import ENV, ROOT

    # The demo's wait in a process group of its own, as a terminal's foreground job: Ctrl-C reaches both processes.
    # Python's own SIGINT handler, as in a terminal: a shell that started this test in the background left the
    # signal ignored, and the waiter would inherit that.
    waiter = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "sys.path.insert(0, 'experiments'); import demo; "
              f"sys.exit(demo.run_to_end([sys.executable, '-c', {_LAUNCHER!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", waiter], cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stderr.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=30) == demo.INTERRUPTED
        assert "final checkpoint written" in rest  # the demo waited for the run's shutdown instead of killing it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
