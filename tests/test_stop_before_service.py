"""A learner or evaluator asked to stop while its replay service has not come up exits at once."""

import os
import signal
import subprocess
import time

import pytest
from launch_support import TINY, wait_for

from actorq_jax.launch.config import save_config
from actorq_jax.launch.flags import parse_run
from actorq_jax.launch.placement import worker_command, worker_env
from actorq_jax.launch.runtime import free_port

pytestmark = pytest.mark.process


@pytest.mark.timeout(150)
@pytest.mark.parametrize("role", ["learner", "evaluator"])
def test_a_worker_waiting_for_a_service_that_never_came_up_stops_at_once_on_sigterm(tmp_path, role):
    results = tmp_path / "run"
    results.mkdir()
    run, agent = parse_run("d4pg", [*TINY, "--results_dir", str(results)])
    save_config(results / "config.json", run, agent)
    # Nothing listens on this port: the worker waits for the service (the learner up to 300 s).
    command = worker_command(role, os.getpid(), results, ["--server", f"127.0.0.1:{free_port()}"])
    log_path = tmp_path / f"{role}.log"
    with open(log_path, "w") as log_file:
        worker = subprocess.Popen(command, env=worker_env(), stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "waiting for the replay service" in log_path.read_text(), 90, f"the {role}'s wait", worker)
        time.sleep(1.0)  # well inside the wait's probing loop
        asked = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=60)
        stopped_in = time.monotonic() - asked
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    log_text = log_path.read_text()
    assert code == 0, log_text
    assert "stop requested before the replay service" in log_text
    # Its own wait would have run 60-300 s; a probe takes at most about a second.
    assert stopped_in < 15.0, (stopped_in, log_text)
