"""The launcher's watchdogs for live but silent workers, and the evaluator's reports they read."""

import io
import subprocess
import sys
import threading
import time

import psutil
import pytest

from actorq_jax.launch.channel import FileChannel
from actorq_jax.launch.config import RunConfig
from actorq_jax.launch.evaluator import (
    EPISODE_SLACK,
    FETCH_QUIET_S,
    FIRST_EPISODE_S,
    QUIET_MARGIN_S,
    Heartbeat,
)
from actorq_jax.launch.launcher import SERVICE_HEARD_S, Launcher, Silence, Worker


def test_a_silence_counts_from_the_last_new_report_and_only_past_what_that_report_allowed():
    silence = Silence()
    assert silence.over(1e9) is None  # nothing heard yet: nothing allowed, nothing over
    assert silence.heard(("pid", 1), 10.0, now=100.0)
    assert not silence.heard(("pid", 1), 99.0, now=105.0)  # the same report read again is not news
    assert silence.over(now=109.0) is None
    assert silence.over(now=110.5) == pytest.approx(10.5)
    assert silence.heard(("pid", 2), 5.0, now=111.0)
    assert silence.over(now=115.0) is None and silence.over(now=116.5) == pytest.approx(5.5)
    assert not silence.heard(None, 1.0, now=200.0)  # no report at all changes nothing


def test_the_evaluator_allows_a_compile_until_each_policy_has_run_an_episode_then_a_multiple_of_the_longest(tmp_path):
    channel = FileChannel(tmp_path)
    beat = Heartbeat(channel, ("fp32", "actor"))
    beat("waiting")
    first = channel.read("evaluator")
    assert first["quiet_s"] == FETCH_QUIET_S + FIRST_EPISODE_S + QUIET_MARGIN_S and first["beat"] == 1
    beat("evaluating", episode_s=("fp32", 2.0))
    assert channel.read("evaluator")["quiet_s"] == FETCH_QUIET_S + FIRST_EPISODE_S + QUIET_MARGIN_S  # actor's next
    beat("evaluating", episode_s=("actor", 3.0))
    beat("evaluating", episode_s=("actor", 1.0))  # a shorter episode does not shrink the allowance
    report = channel.read("evaluator")
    assert report["quiet_s"] == pytest.approx(FETCH_QUIET_S + EPISODE_SLACK * 3.0 + QUIET_MARGIN_S)
    assert report["beat"] == 4 and report["phase"] == "evaluating"


@pytest.fixture
def frozen_evaluator(tmp_path):
    """A launcher writing to a string, and a sleeping process to stand as its evaluator (killed afterwards)."""
    stream = io.StringIO()
    launcher = Launcher(RunConfig(task="cartpole_balance", results_dir=str(tmp_path)), None, stream)
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield launcher, stream, frozen
    if frozen.poll() is None:
        frozen.kill()
        frozen.wait()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_shutdown_does_not_wait_out_its_timeout_for_an_evaluator_that_stopped_reporting(frozen_evaluator):
    # A stopped evaluator at the end of a run: killed once past the silence its last report allowed, not after
    # the 600 s its final evaluation may take while it reports.
    launcher, stream, frozen = frozen_evaluator
    channel = launcher.channel
    beating = threading.Event()

    def service_beats() -> None:
        beat = 0
        while not beating.wait(0.2):
            beat += 1
            channel.report("replay", {"incarnation": 1, "beat": beat})

    thread = threading.Thread(target=service_beats, daemon=True)
    try:
        channel.report("replay", {"incarnation": 1, "beat": 0})
        launcher._hear_service()
        thread.start()
        psutil.Process(frozen.pid).suspend()
        channel.report("evaluator", {"phase": "final", "pid": frozen.pid, "beat": 7, "quiet_s": 2.0})
        evaluator = Worker("evaluator", "evaluator", [], 1, process=frozen)
        started = time.monotonic()
        launcher._terminate([evaluator], 600.0, killed_silent=launcher._evaluator_killed_silent)
        took = time.monotonic() - started
    finally:
        beating.set()
        thread.join()
    assert frozen.returncode == -9  # killed: SIGTERM waits on a stopped process
    assert 2.0 <= took < 2.0 + 2 * SERVICE_HEARD_S, took
    assert "the evaluator has not reported for 2 s but is alive (stopped or hung); killing it" in stream.getvalue()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_an_evaluator_whose_service_went_quiet_is_not_blamed_for_its_own_silence(frozen_evaluator):
    # Under Ray its reports travel through the service: while the service is not heard, its silence is not its.
    launcher, _, frozen = frozen_evaluator
    channel = launcher.channel
    channel.report("replay", {"incarnation": 1, "beat": 0})
    launcher._hear_service()
    launcher._service_silence.heard_at = time.monotonic() - SERVICE_HEARD_S - 1.0  # and not since
    channel.report("evaluator", {"phase": "final", "pid": frozen.pid, "beat": 7, "quiet_s": 1.0})
    evaluator = Worker("evaluator", "evaluator", [], 1, process=frozen)
    deadline = time.monotonic() + SERVICE_HEARD_S + 3.0
    while time.monotonic() < deadline:
        assert not launcher._silent_past_allowed(evaluator, channel.read("evaluator"), launcher._evaluator_silence)
        time.sleep(0.2)
    assert frozen.poll() is None
