"""Workers forked from the template (launch/forker.py) behave as started subprocesses of the launcher."""

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from launch_support import ENV, TINY, wait_for

from actorq_jax.launch.config import save_config
from actorq_jax.launch.flags import parse_run
from actorq_jax.launch.forker import WorkerForker, can_fork_here
from actorq_jax.launch.placement import worker_command, worker_env
from actorq_jax.launch.runtime import command_words, free_port

pytestmark = pytest.mark.process


def _subreaper() -> bool:
    flag = ctypes.c_int(0)
    ctypes.CDLL("libc.so.6").prctl(37, ctypes.byref(flag), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
    return bool(flag.value)


@pytest.fixture
def forker(tmp_path):
    # The template as a process of its own, as any process with threads starts it (the next tests say when).
    forker = WorkerForker(tmp_path / "template.log", worker_env(), fork_here=False)
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


# A single-threaded process (the command-line launcher) forks the template from its own image.
_FORK_HERE = """
import json, os, sys, time
import psutil
from actorq_jax.launch.forker import WorkerForker, can_fork_here
from actorq_jax.launch.placement import worker_command, worker_env
from actorq_jax.launch.runtime import command_words, free_port
from actorq_jax.agents.registry import get_agent
from actorq_jax.launch.config import save_config
from actorq_jax.launch.flags import parse_run
tmp = sys.argv[1]
assert can_fork_here()
forker = WorkerForker(os.path.join(tmp, "template.log"), worker_env())
template = forker.ensure_running()
with open(f"/proc/{template.pid}/cmdline") as f:
    template_command = f.read()
with open(f"/proc/{os.getpid()}/cmdline") as f:
    own_command = f.read()
run, agent = parse_run("d4pg", [*get_agent("d4pg").tiny, "--results_dir", tmp])
save_config(os.path.join(tmp, "config.json"), run, agent)
# An evaluator of a service that never comes up: it runs until it is killed.
command = worker_command("evaluator", os.getpid(), tmp, ["--server", f"127.0.0.1:{free_port()}"])
listener = forker.start(command, os.path.join(tmp, "evaluator.log"), worker_env())
deadline = time.monotonic() + 30
while command_words(psutil.Process(listener.pid))[-2:] != command[-2:] and time.monotonic() < deadline:
    time.sleep(0.05)
titled = command_words(psutil.Process(listener.pid)) == command
listener.kill()
listener.wait()
worker = forker.start(worker_command("no_such_role", os.getpid(), tmp, []), os.path.join(tmp, "bad.log"), worker_env())
code = worker.wait(timeout=60)
forker.close()
print(json.dumps({"same_image": template_command == own_command, "titled": titled, "code": code, "ppid": os.getppid(),
                  "template_ended": template.poll() is not None, "mujoco_gl": os.environ.get("MUJOCO_GL")}))
"""


@pytest.mark.timeout(120)
def test_a_single_threaded_launcher_forks_the_template_from_its_own_image(tmp_path):
    env = {k: v for k, v in ENV.items() if k != "MUJOCO_GL"}
    proc = subprocess.run([sys.executable, "-c", _FORK_HERE, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Only the script's own line on its output: the template and the worker write nothing to the caller's pipes
    # (run() returned, so neither held them open past the script's exit).
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    # The worker under its own command line (tests and users find roles by it), although forked from the script.
    assert outcome == {"same_image": True, "titled": True, "code": 2, "ppid": os.getpid(), "template_ended": True,
                       "mujoco_gl": "disable"}, outcome
    assert "invalid choice: 'no_such_role'" in (tmp_path / "bad.log").read_text()


# gRPC's threads are no Python threads, but a fork would copy them mid-work as well: no template forked here
# while a Reverb client and server live, and again once they are gone.
_GRPC_THREADS = """
import gc, json
import reverb
from actorq_jax.launch.forker import can_fork_here
from actorq_jax.replay import ReplayServer
from actorq_jax.replay.messages import make_message_table
before = can_fork_here()
server = ReplayServer([make_message_table("inbox")])  # not Reverb's bare Server, whose checkpoint folder stays behind
client = reverb.Client(server.local_address)
client.server_info(timeout=5)
during = can_fork_here()
server.stop()
del client, server
gc.collect()
print(json.dumps([before, during, can_fork_here()]))
"""


@pytest.mark.timeout(120)
def test_no_template_is_forked_from_a_process_whose_reverb_client_lives():
    proc = subprocess.run([sys.executable, "-c", _GRPC_THREADS], env=ENV, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, False, True]


@pytest.mark.timeout(120)
def test_a_process_with_threads_starts_the_template_as_a_process_of_its_own(tmp_path):
    # pytest's own threads (xdist, timeouts) or any other: a fork could copy a lock one of them holds.
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)
    helper.start()
    try:
        assert not can_fork_here()
        forker = WorkerForker(tmp_path / "template.log", worker_env())
        template = forker.ensure_running()
        try:
            # Popen returns once the exec began; /proc/PID/cmdline reads empty until the kernel has set up the
            # new image's arguments, a moment later.
            process = psutil.Process(template.pid)
            wait_for(lambda: command_words(process) != [], 30, "the template's command line", template)
            assert command_words(process)[-2:] == ["-m", "actorq_jax.launch.forker"]
        finally:
            forker.close()
    finally:
        stop.set()
        helper.join()
