"""Faults lose nothing: a killed learner comes back against the live replay service, a killed launcher takes
its workers with it, remote actors leave a dead learner with one clear line, bad payloads and config rows are refused.

Real launchers, learners, actors and Reverb servers on the loopback; each test bounded by pytest-timeout.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
import reverb
from launch_support import (
    ENV,
    ROOT,
    TINY,
    alive,
    rows,
    start_remote_actor,
    start_run,
    status,
    stop_all,
    wait_for,
    worker_process,
)
from service_support import dqn_service_learner_actor

from actorq_jax.launch import runtime
from actorq_jax.launch.actor import fetch_config
from actorq_jax.launch.checkpoint import read_counters
from actorq_jax.launch.learner import Learner
from actorq_jax.replay import ReplayServer, make_variables_table
from actorq_jax.replay.server import checkpoint_items, checkpoint_table_size
from actorq_jax.replay.variables import insert_wire

# Every test here starts a launcher, a worker or a Reverb server.
pytestmark = pytest.mark.process


def _monotonic(values, strict: bool = False) -> bool:
    pairs = list(zip(values, values[1:]))
    return all(b > a for a, b in pairs) if strict else all(b >= a for a, b in pairs)


def _assert_counters_never_go_backwards(results) -> None:
    learner = rows(results / "learner.csv")
    assert learner, "no learner.csv rows"
    assert _monotonic([r["learner_steps"] for r in learner], strict=True), [r["learner_steps"] for r in learner]
    assert _monotonic([r["env_steps"] for r in learner]), [r["env_steps"] for r in learner]
    for path in (results / "actors").glob("actor_*.csv"):
        actor = rows(path)
        assert all(set(r) and None not in r.values() for r in actor), f"malformed row in {path}"
        assert _monotonic([r["env_steps"] for r in actor], strict=True), path
    # Evaluations follow the learner's surviving timeline too (a restore drops those past its step).
    evaluated = [r["learner_steps"] for r in rows(results / "eval.csv")]
    assert evaluated and _monotonic(evaluated), evaluated


def _replay_items(results, checkpoint: str) -> int:
    return checkpoint_table_size(results / "replay_checkpoints", checkpoint, "replay")


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_killed_learner_comes_back_against_the_live_replay_and_actors_keep_going(tmp_path):
    results, remote_dir = tmp_path / "run", tmp_path / "remote"
    proc = start_run(results, *TINY, "--num_actors", "1", "--max_seconds", "400", "--server_timeout_s", "120",
                     "--max_learner_restarts", "1")
    remote = None
    try:
        service = wait_for(lambda: status(results, "replay").get("address") and status(results, "replay"), 150,
                           "the replay service", proc)
        first = wait_for(lambda: status(results).get("phase") == "running" and status(results), 150, "the learner", proc)
        remote = start_remote_actor(service["local_address"], remote_dir, "--actor_id", "7")
        wait_for(lambda: read_counters(results / "checkpoints") and rows(remote_dir / "actor_7.csv"), 240,
                 "a checkpoint and a remote episode", proc)
        os.kill(first["pid"], signal.SIGKILL)
        last = read_counters(results / "checkpoints")  # what the dead learner could prove
        items_at_kill = status(results, "replay")["items"]
        episodes = {p: len(rows(p)) for p in (results / "actors" / "actor_0.csv", remote_dir / "actor_7.csv")}
        back = wait_for(lambda: status(results).get("pid") not in (None, first["pid"])
                        and status(results).get("phase") == "running" and status(results), 150,
                        "the restarted learner", proc)
        restored = back["restored"]
        # State from its checkpoint; replay is the service's live table, which lost nothing.
        assert restored["learner_steps"] == last["learner_steps"] and restored["checkpoint"] == last["replay_checkpoint"]
        assert restored["items"] >= items_at_kill > 0
        assert status(results, "replay")["pid"] == service["pid"]
        # The local actor and the remote one (both started before the crash) write again.
        wait_for(lambda: all(len(rows(p)) > n for p, n in episodes.items()), 240, "episodes after the restart", proc)
        assert status(results)["env_steps"] > restored["env_steps"]
        assert remote.poll() is None
        # Killed again, past --max_learner_restarts: the run stops, its summary from the last checkpoint.
        wait_for(lambda: read_counters(results / "checkpoints")["learner_steps"] > last["learner_steps"], 240,
                 "a checkpoint after the restart", proc)
        os.kill(back["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=200)
        assert proc.returncode == 1, out[-3000:]
    finally:
        stop_all(proc, remote)
    summary = json.loads((results / "summary.json").read_text())
    assert any("restart 1/1" in e for e in summary["events"]), summary["events"]
    assert any("after 1 restarts; stopping the run" in e for e in summary["events"]), summary["events"]
    assert not any(e.startswith("actor_0 died") for e in summary["events"]), summary["events"]
    proven = read_counters(results / "checkpoints")
    assert summary["exit_code"] == 1 and summary["counters_from"] == f"checkpoint at learner step {proven['learner_steps']}"
    assert (summary["learner_steps"], summary["env_steps"]) == (proven["learner_steps"], proven["env_steps"])
    assert set(summary["last_status_report"]) == {"learner_steps", "env_steps", "wall_seconds"}
    _assert_counters_never_go_backwards(results)
    # The remote actor's rows that reached the results directory are its own, each once.
    forwarded = rows(results / "actors" / "actor_7.csv")
    assert forwarded and all(r in rows(remote_dir / "actor_7.csv") for r in forwarded)

    # A stopped run resumes on its port: the service with the replay of the final checkpoint, the learner its state.
    final = read_counters(results / "checkpoints")
    resumed = subprocess.run([sys.executable, "experiments/run_d4pg.py", "--resume", str(results),
                              "--max_learner_steps", str(final["learner_steps"] + 50)],
                             cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    again = status(results, "replay")
    assert again["local_address"] == service["local_address"]
    assert again["restored"]["checkpoint"] == final["replay_checkpoint"]
    assert again["restored"]["items"] == _replay_items(results, final["replay_checkpoint"]) > 0
    assert status(results)["restored"]["learner_steps"] == final["learner_steps"]
    assert json.loads((results / "summary.json").read_text())["learner_steps"] == final["learner_steps"] + 50
    _assert_counters_never_go_backwards(results)  # rows of the lost timeline (after the checkpoint) are gone


@pytest.mark.timeout(360)
def test_killed_launcher_takes_every_worker_and_remote_actors_leave(tmp_path):
    results, remote_dir = tmp_path / "run", tmp_path / "remote"
    proc = start_run(results, *TINY, "--num_actors", "1", "--max_seconds", "300")
    remote = None
    try:
        first = wait_for(lambda: status(results, "replay").get("address") and status(results, "replay"), 150,
                         "the replay service", proc)
        remote = start_remote_actor(first["local_address"], remote_dir, "--actor_id", "7", "--server_timeout_s", "10")
        wait_for(lambda: read_counters(results / "checkpoints") and rows(remote_dir / "actor_7.csv"), 240,
                 "a checkpoint and a remote episode", proc)
        workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(workers) >= 4  # replay service, learner, actor, evaluator
        proc.kill()  # as the OOM killer would
        proc.wait()
        wait_for(lambda: not alive(workers), 30, "every worker to exit")
        learner_gone = time.monotonic()
        out, _ = remote.communicate(timeout=60)
        remote_left = time.monotonic() - learner_gone
    finally:
        stop_all(proc, remote)
    # The learner's final checkpoint is there: at the step of its last report.
    final = status(results)
    assert final["phase"] == "done"
    assert read_counters(results / "checkpoints")["learner_steps"] == final["learner_steps"]
    # The remote actor said why in one line, within its timeout (+ 10 s), having logged every episode.
    assert remote.returncode == 3, out[-2000:]
    assert remote_left < 10 + 10, remote_left
    lines = [line for line in out.splitlines() if "unreachable for" in line]
    assert len(lines) == 1 and first["local_address"] in lines[0] and "last params version" in lines[0], out[-2000:]
    assert "Traceback" not in out
    episodes = [r["episode"] for r in rows(remote_dir / "actor_7.csv")]
    assert episodes == list(range(1, len(episodes) + 1)) and episodes


@pytest.mark.timeout(420)
def test_a_run_whose_actors_are_all_gone_stops_instead_of_waiting_for_its_budget(tmp_path):
    results = tmp_path / "run"
    # --server_timeout_s is also how long the run waits, its actors all gone, for a remote actor's env step.
    proc = start_run(results, *TINY, "--num_actors", "1", "--max_actor_restarts", "0", "--max_seconds", "600",
                     "--server_timeout_s", "10")
    try:
        # A loaded machine may take minutes to import and compile before the first step.
        wait_for(lambda: status(results).get("learner_steps", 0) > 0, 240, "SGD steps", proc)
        launcher = psutil.Process(proc.pid)
        wait_for(lambda: worker_process(launcher, "actor", 0), 30, "actor 0").kill()
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=200)
        stopped_after = time.monotonic() - killed
    finally:
        stop_all(proc)
    # Stopped on its own, long before its 600 s budget, saying why, with what it collected.
    assert proc.returncode == 1, out[-3000:]
    assert stopped_after < 150, stopped_after
    summary = json.loads((results / "summary.json").read_text())
    assert summary["exit_code"] == 1
    assert any(e.startswith("every actor died after its restarts and no env step arrived for 10 s")
               for e in summary["events"]), summary["events"]
    assert summary["learner_steps"] > 0 and read_counters(results / "checkpoints")


@pytest.mark.timeout(300)
def test_malformed_payload_is_rejected_and_the_actor_keeps_its_parameters(tmp_path):
    results = tmp_path / "run"
    csv_path = results / "actors" / "actor_0.csv"
    # The learner publishes only at its start, so the stray payload stays in the table until the end.
    proc = start_run(results, *TINY, "--num_actors", "1", "--publish_period", "1000000", "--eval_period", "1000000",
                     "--max_seconds", "300")
    try:
        address = wait_for(lambda: status(results, "replay").get("local_address"), 150, "the replay service", proc)
        wait_for(lambda: rows(csv_path), 150, "actor 0's first episode", proc)
        insert_wire(reverb.Client(address), runtime.VARIABLES_TABLE,
                    [np.frombuffer(b'{"format": "actorq-wire", "format_version": 1}', np.uint8)])
        rejected_at = wait_for(lambda: next((i for i, r in enumerate(rows(csv_path)) if r["rejected_payloads"]), None),
                               150, "the rejection in actor 0's CSV", proc)
        wait_for(lambda: len(rows(csv_path)) > rejected_at + 1, 150, "an episode after the rejection", proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=200)
        assert proc.returncode == 0, out[-3000:]
    finally:
        stop_all(proc)
    summary = json.loads((results / "summary.json").read_text())
    assert not any("died" in e for e in summary["events"]), summary["events"]
    actor = rows(csv_path)
    assert [r["rejected_payloads"] for r in actor[rejected_at:]] == [1] * len(actor[rejected_at:])
    assert {r["params_version"] for r in actor} == {0}  # the last good parameters, kept
    log = (results / "logs" / "actor_0.log").read_text()
    assert log.count("rejected the variables payload") == 1


MALFORMED_CONFIG_ROWS = [b'{"run": {"agent": "d4pg"', b'{"run": {"agent": "nope"}, "agent": {}}', b"\xff\xfe"]


def _config_server(row: bytes) -> ReplayServer:
    server = ReplayServer([make_variables_table(runtime.CONFIG_TABLE)])
    server.client().insert([np.frombuffer(row, np.uint8)], {runtime.CONFIG_TABLE: 1.0})
    return server


@pytest.mark.parametrize("row", MALFORMED_CONFIG_ROWS)
def test_a_malformed_config_row_is_named_with_the_server(row):
    with _config_server(row) as server:
        with pytest.raises(ValueError, match=f"the config table on 127.0.0.1:{server.port} holds a malformed row"):
            fetch_config(f"127.0.0.1:{server.port}", 5)


@pytest.mark.timeout(120)
def test_remote_actor_exits_clearly_on_a_malformed_config_row(tmp_path):
    with _config_server(MALFORMED_CONFIG_ROWS[0]) as server:
        proc = subprocess.run([sys.executable, "-m", "actorq_jax.launch.actor", "--server", f"127.0.0.1:{server.port}",
                               "--log_dir", str(tmp_path), "--server_timeout_s", "5"],
                              cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "malformed row" in proc.stderr and f"127.0.0.1:{server.port}" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(300)
def test_a_connected_actor_has_its_policy_compiled_and_its_first_steps_compile_nothing(tmp_path):
    # run_actor takes the id lease, whose watchdog counts --actor_hang_s, after connect(): a compile left to the
    # first step would count against it as a main loop that made no progress.
    with dqn_service_learner_actor(tmp_path) as (_, _, actor):
        assert actor.act._cache_size() == 1
        assert actor.steps == 0 and actor.total_steps == 0  # compiling acted in no environment
        while actor.total_steps < 20:
            actor.run_episode()
        assert actor.act._cache_size() == 1  # the real observations met the compiled shapes and dtypes


@pytest.mark.timeout(300)
def test_new_dqn_items_are_sampled_at_the_max_priority(tmp_path):
    with dqn_service_learner_actor(tmp_path, update_period=10) as (service, learner, actor):
        while learner.items() < 60:
            actor.run_episode()  # written at priority 1.0: nothing was written back yet
        checkpoints = service.server.checkpoint_dir
        old = checkpoint_items(checkpoints, service.server.checkpoint("before"), "replay")
        while learner.step() is None:
            pass
        for _ in range(4):
            learner.step()
        assert learner.feedback.max_priority > 1.0  # the TD errors of a fresh network on CartPole's rewards
        learner.publish()  # the actors learn the max priority with the parameters
        assert learner.publisher.flush(timeout_s=60)
        actor.variables.update(wait=True)
        assert actor.variables.meta == {"max_priority": learner.feedback.max_priority}
        actor.run_episode()
        items = checkpoint_items(checkpoints, service.server.checkpoint("after"), "replay")
        new = {key: priority for key, priority in items.items() if key not in old}
        assert len(old) >= 60 and new
        assert set(np.float32(list(new.values()))) == {np.float32(learner.feedback.max_priority)}
        # The learner's checkpoint keeps it, and a learner restarted from that checkpoint goes on from it.
        stop = threading.Event()
        service.serve_in_thread(stop)  # answers the learner's checkpoint request
        try:
            assert learner.checkpoint()
        finally:
            stop.set()
        assert read_counters(tmp_path / "checkpoints")["max_priority"] == learner.feedback.max_priority
        restarted = Learner(learner.builder, dataclasses.replace(learner.run, resume=True), tmp_path, learner.address)
        try:
            assert restarted.steps == learner.steps and restarted.feedback.max_priority == learner.feedback.max_priority
        finally:
            restarted.publisher.close()
            restarted.checkpointer.close()


@pytest.mark.process
@pytest.mark.timeout(300)
def test_an_actor_stuck_in_a_call_that_releases_the_gil_exits_and_is_restarted(tmp_path):
    # A stuck call that releases the GIL leaves the actor's lease thread running: without the main loop's beats
    # the lease would be renewed for ever and the launcher would never notice.
    import hanging_agent

    from actorq_jax.agents.registry import AGENT_MODULES_ENV

    results, hang_file = tmp_path / "run", tmp_path / "hang"
    env = {**ENV, AGENT_MODULES_ENV: hanging_agent.MODULE, hanging_agent.HANG_FILE_ENV: str(hang_file),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "tests"), ENV.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, "experiments/run.py", "--agent", hanging_agent.NAME, *TINY,
                             "--num_actors", "1", "--actor_hang_s", "10", "--max_seconds", "240",
                             "--results_dir", str(results)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        launcher = psutil.Process(proc.pid)
        wait_for(lambda: status(results, "replay").get("env_steps", 0) >= 200, 150, "the actor's first steps", proc)
        stuck = worker_process(launcher, "actor", 0)
        hang_file.write_text(str(stuck.pid))
        stuck_at = time.monotonic()
        wait_for(lambda: worker_process(launcher, "actor", 0, restart=1), 90, "actor 0's restart", proc)
        # Not before its main loop had been quiet for --actor_hang_s (the call it is stuck in began at the write).
        assert time.monotonic() - stuck_at >= 9.5
        assert alive([stuck.pid]) == []
        steps = status(results, "replay").get("env_steps", 0)
        wait_for(lambda: status(results, "replay").get("env_steps", 0) >= steps + 200, 120, "the restart's steps", proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        stop_all(proc)
    assert proc.returncode == 0, out[-3000:]
    events = json.loads((results / "summary.json").read_text())["events"]
    died = [e for e in events if e.startswith("actor_0 died")]
    assert len(died) == 1 and f"exit code {runtime.EXIT_HUNG}: its main loop hung" in died[0], events
    log = (results / "logs" / "actor_0.log").read_text()
    assert "actor id 0: its main loop has made no progress for" in log and "giving the id back" in log, log[-3000:]


@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_run_stopped_and_continued_whole_goes_on_without_a_restart(tmp_path):
    # Ctrl-Z then fg: every process of the run stopped at once, for longer than the service's allowed silence (15 s)
    # and the actor's --actor_hang_s, then continued. Nobody was silent of its own accord: nobody is killed.
    results = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "experiments/run_d4pg.py", *TINY, "--num_actors", "1", "--actor_hang_s", "10",
                             "--server_timeout_s", "8", "--max_seconds", "250", "--results_dir", str(results)],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: status(results).get("learner_steps", 0) >= 20, 150, "the learner's first steps", proc)
        wait_for(lambda: status(results, "replay").get("env_steps", 0) >= 200, 150, "the actor's first steps", proc)
        os.killpg(proc.pid, signal.SIGSTOP)
        time.sleep(20)
        os.killpg(proc.pid, signal.SIGCONT)
        steps = status(results).get("learner_steps", 0)
        wait_for(lambda: status(results).get("learner_steps", 0) >= steps + 50, 60, "SGD steps after it", proc)
        time.sleep(5)  # past every watchdog's next look
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
        stop_all(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "the launcher's watch was away for" in out, out[-3000:]
    summary = json.loads((results / "summary.json").read_text())
    assert not [e for e in summary["events"] if " died " in e or "killing it" in e], summary["events"]
    assert summary["learner_restarts"] == 0 and summary["replay_restarts"] == 0


@pytest.mark.process
@pytest.mark.timeout(300)
def test_an_actor_and_the_service_that_die_while_the_learner_restarts_are_restarted_without_waiting_for_it(tmp_path):
    results = tmp_path / "run"
    proc = start_run(results, *TINY, "--num_actors", "1", "--max_seconds", "250")
    restarted = None
    try:
        launcher = psutil.Process(proc.pid)
        wait_for(lambda: read_counters(results / "checkpoints"), 150, "a first checkpoint", proc)
        worker_process(launcher, "learner").kill()
        # The restarted learner is held (SIGSTOP) before it restores: the launcher waits for it to come back.
        deadline = time.monotonic() + 60
        while restarted is None and time.monotonic() < deadline:
            restarted = worker_process(launcher, "learner", restart=1)
            time.sleep(0.02)
        assert restarted is not None, "the learner was not restarted"
        restarted.suspend()
        assert status(results).get("pid") != restarted.pid  # caught before it reported
        worker_process(launcher, "actor", 0).kill()
        wait_for(lambda: worker_process(launcher, "actor", 0, restart=1), 30, "actor 0's restart", proc)
        # The service too (the held learner waits for it: before, the launcher waited for the learner, which
        # never came, and stopped the run after its start timeout).
        service = status(results, "replay")["pid"]
        os.kill(service, signal.SIGKILL)
        wait_for(lambda: status(results, "replay").get("pid") not in (None, service)
                 and status(results, "replay").get("phase") == "running", 60, "the service's restart", proc)
        restarted.resume()

        def trains_again() -> bool:
            report = status(results)
            return (report.get("pid") == restarted.pid and report.get("phase") == "running"
                    and report.get("learner_steps", 0) >= report.get("restored", {}).get("learner_steps", 0) + 20)

        # SGD steps past the restore: the launcher has long seen it back (a stop during the wait would end it).
        wait_for(trains_again, 120, "the restarted learner's SGD steps", proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if restarted is not None and restarted.is_running():
            restarted.resume()
        stop_all(proc)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((results / "summary.json").read_text())
    events = summary["events"]
    order = [next(i for i, e in enumerate(events) if e.startswith(prefix))
             for prefix in ("learner died", "actor_0 died", "replay died", "replay service back on port",
                            "learner back at step")]
    assert order == sorted(order), events
    assert summary["learner_restarts"] == 1 and summary["replay_restarts"] == 1
