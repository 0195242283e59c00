"""Workers forked from the template (launch/forker.py) behave as started subprocesses of the launcher."""

import ctypes
import os
import signal
import time

import psutil
import pytest
from launch_support import TINY, wait_for

from actorq_jax.launch.config import save_config
from actorq_jax.launch.flags import parse_run
from actorq_jax.launch.forker import WorkerForker
from actorq_jax.launch.placement import worker_command, worker_env
from actorq_jax.launch.runtime import command_words, free_port

pytestmark = pytest.mark.process


def _subreaper() -> bool:
    flag = ctypes.c_int(0)
    ctypes.CDLL("libc.so.6").prctl(37, ctypes.byref(flag), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
    return bool(flag.value)


@pytest.fixture
def forker(tmp_path):
    forker = WorkerForker(tmp_path / "template.log", worker_env())
    yield forker
    forker.close()


@pytest.mark.timeout(120)
def test_a_forked_worker_is_our_child_under_its_own_command_line_and_reports_how_it_ended(tmp_path, forker):
    results = tmp_path / "run"
    results.mkdir()
    run, agent = parse_run("d4pg", [*TINY, "--results_dir", str(results)])
    save_config(results / "config.json", run, agent)
    # An evaluator of a service that never comes up: it runs until it is killed.
    command = worker_command("evaluator", os.getpid(), results, ["--server", f"127.0.0.1:{free_port()}"])
    worker = forker.start(command, tmp_path / "evaluator.log", worker_env())
    process = psutil.Process(worker.pid)
    assert process.ppid() == os.getpid()
    # The worker sets its title first thing, moments after the fork.
    wait_for(lambda: command_words(process)[-8:] == command[-8:], 30, "the worker's command line")
    assert worker.poll() is None
    time.sleep(1.0)
    worker.send_signal(signal.SIGKILL)
    assert worker.wait(timeout=30) == -signal.SIGKILL
    # A pid that is no longer ours is never signalled.
    worker.send_signal(signal.SIGTERM)


@pytest.mark.timeout(120)
def test_a_worker_that_fails_at_once_exits_with_its_code_and_its_message_in_its_log(tmp_path, forker):
    command = worker_command("no_such_role", os.getpid(), tmp_path, [])
    worker = forker.start(command, tmp_path / "bad.log", worker_env())
    assert worker.wait(timeout=60) == 2
    assert "invalid choice: 'no_such_role'" in (tmp_path / "bad.log").read_text()
    # The template serves the next worker after a failed one.
    again = forker.start(command, tmp_path / "bad_again.log", worker_env())
    assert again.wait(timeout=60) == 2


@pytest.mark.timeout(120)
def test_the_template_ends_when_closed_and_a_later_start_brings_a_new_one(tmp_path, forker):
    first = forker.ensure_running()
    assert _subreaper()
    forker.close()
    assert first.poll() is not None
    # Orphans of this process's later children are not ours to collect any more.
    assert not _subreaper()
    command = worker_command("no_such_role", os.getpid(), tmp_path, [])
    assert forker.start(command, tmp_path / "bad.log", worker_env()).wait(timeout=60) == 2
    assert forker.ensure_running().pid != first.pid


@pytest.mark.timeout(120)
def test_a_dead_template_is_replaced_on_the_next_start(tmp_path, forker):
    command = worker_command("no_such_role", os.getpid(), tmp_path, [])
    first = forker.ensure_running()
    first.kill()
    first.wait()
    # A restart after the template was lost (killed, out of memory) still starts its worker.
    assert forker.start(command, tmp_path / "bad.log", worker_env()).wait(timeout=60) == 2
    assert forker.ensure_running().pid != first.pid
