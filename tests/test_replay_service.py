"""The replay service as a process of its own: the learner holds no server, and each can die without the other."""

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import reverb
from launch_support import ENV, ROOT, TINY, first_seen, rows, start_run, status, stop_all, wait_for, worker_process
from service_support import dqn_service_learner_actor

from actorq_jax.launch.checkpoint import read_counters
from actorq_jax.launch.config import RunConfig
from actorq_jax.launch.flags import parse_run
from actorq_jax.launch.runtime import EVAL_VARIABLES_TABLE, VARIABLES_TABLE, role_cpus
from actorq_jax.replay.server import checkpoint_table_size


@pytest.mark.parametrize("flags, says", [
    (["--replay_cpus", "1-0"], "--replay_cpus: malformed core list '1-0'"),
    (["--replay_cpus", "4096"], "--replay_cpus: core(s) [4096] are not available"),
    (["--layout", "spread"], "--layout: 'spread' not in ('shared', 'pinned')"),
    (["--max_replay_restarts", "-1"], "--max_replay_restarts: must be >= 0, got -1"),
    (["--learner_platform", "tpu"], "--learner_platform: 'tpu' not in"),
])
def test_bad_topology_flags_exit_2_naming_the_flag(flags, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_run("d4pg", [*flags, "--results_dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_pinned_layout_gives_the_learner_the_first_core_and_flags_override_it(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 5})
    run = RunConfig(task="cartpole_balance", results_dir="r", layout="pinned")
    assert role_cpus("learner", run) == (2,)
    assert [role_cpus(role, run) for role in ("replay", "actor", "evaluator")] == [(3, 5)] * 3
    run = RunConfig(task="cartpole_balance", results_dir="r", layout="pinned", replay_cpus="5", learner_cpus="3")
    assert (role_cpus("learner", run), role_cpus("replay", run), role_cpus("actor", run)) == ((3,), (5,), (3, 5))
    shared = RunConfig(task="cartpole_balance", results_dir="r")
    assert [role_cpus(role, shared) for role in ("learner", "replay", "actor")] == [()] * 3


@contextlib.contextmanager
def _serving_tiny_d4pg_service(results_dir):
    """A replay service of a tiny D4PG on cartpole_balance, its loop served from a thread of this process."""
    from actorq_jax.agents.d4pg.config import D4PGConfig
    from actorq_jax.environments import environment_spec, make_environment
    from actorq_jax.launch import runtime
    from actorq_jax.launch.replay_service import ReplayService

    run = RunConfig(task="cartpole_balance", results_dir=str(results_dir))
    agent = D4PGConfig(policy_layers=(8,), critic_layers=(8,))
    builder = runtime.make_builder("d4pg", agent, environment_spec(make_environment("cartpole_balance", seed=0)))
    service = ReplayService(builder, run, results_dir, "{}", resume=False)
    done = threading.Event()
    served = service.serve_in_thread(done)  # the service process's loop, in a thread of this one
    try:
        yield service
    finally:
        done.set()
        served.join()
        service.stop()


@pytest.mark.process
@pytest.mark.timeout(120)
def test_service_answers_checkpoint_requests_and_refuses_bad_ones(tmp_path):
    from actorq_jax.launch.replay_service import ServiceClient, ServiceError

    with _serving_tiny_d4pg_service(tmp_path) as service:
        # A local run advertises the loopback: no host name to resolve, nothing sent off this machine.
        assert service.server.address == f"127.0.0.1:{service.server.port}"
        client = ServiceClient(service.client, timeout_s=10)
        for name in ("step_1", "step_2", "step_3"):
            assert client.checkpoint(name, keep=["step_1"])["name"] == name
        # Only the checkpoints asked to be kept, and the new one, stay on disk.
        kept = sorted(p.name for p in (tmp_path / "replay_checkpoints").iterdir() if p.name.startswith("step"))
        assert kept == ["step_1", "step_3"]
        with pytest.raises(ServiceError, match="refused 'checkpoint'.*plain directory name"):
            client.checkpoint("../escape", keep=[])
        with pytest.raises(ServiceError, match="unknown request 'compact'"):
            client.request({"op": "compact"})


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_checkpoint_request_outlasts_a_busy_server_and_allows_for_the_tables_size(tmp_path, monkeypatch):
    # A large table's checkpoint holds the server up: a look at the replies table can miss its few seconds
    # (Reverb's DeadlineExceededError) while the checkpoint is being written. Here the first looks miss.
    from actorq_jax.launch.replay_service import CHECKPOINT_S_PER_ITEM, REPLIES_TABLE, ServiceClient, ServiceError
    from actorq_jax.replay import messages

    real_take, missed = messages.take_messages, []

    def busy_then_real(client, table, timeout_s=5):
        # Only the requester's looks at the replies miss; the service's own loop reads its requests as usual.
        if table == REPLIES_TABLE and len(missed) < 3:
            missed.append(table)
            raise reverb.errors.DeadlineExceededError("ServerInfo call did not complete within provided timeout")
        return real_take(client, table, timeout_s)

    def never_answers(client, table, timeout_s=5):
        if table == REPLIES_TABLE:
            raise reverb.errors.DeadlineExceededError("ServerInfo call did not complete within provided timeout")
        return real_take(client, table, timeout_s)

    with _serving_tiny_d4pg_service(tmp_path) as service:
        monkeypatch.setattr(messages, "take_messages", busy_then_real)
        client = ServiceClient(service.client, timeout_s=10)
        assert client.checkpoint("step_1", keep=[])["name"] == "step_1" and len(missed) == 3
        assert (tmp_path / "replay_checkpoints" / "step_1" / "DONE").exists()
        # A server that never answers: the request gives up at its deadline, the table's allowance included.
        monkeypatch.setattr(messages, "take_messages", never_answers)
        client = ServiceClient(service.client, timeout_s=0.5)
        items = int(1.0 / CHECKPOINT_S_PER_ITEM)  # one more second
        start = time.monotonic()
        with pytest.raises(ServiceError, match=r"did not answer 'checkpoint' within 1.5 s"):
            client.checkpoint("step_2", keep=[], items=items)
        assert 1.4 < time.monotonic() - start < 5.0


@pytest.mark.process
@pytest.mark.timeout(180)
def test_a_checkpoint_asked_of_a_service_that_restarted_before_writing_it_is_given_up_at_once(tmp_path, caplog):
    import dataclasses

    from actorq_jax.launch.replay_service import ReplayService

    with dqn_service_learner_actor(tmp_path, server_timeout_s=60.0) as (service, learner, actor):
        while learner.items() < 60:
            actor.run_episode()
        while learner.step() is None:
            pass
        service.report("running")
        # Nobody serves the request: the service dies with it unanswered, as one SIGKILLed while writing would.
        assert learner.checkpoint(wait=False) is False and learner.checkpoint_pending
        port = service.server.port
        service.stop()
        restarted = ReplayService(learner.builder, dataclasses.replace(service.run, port=port), tmp_path, "{}",
                                  resume=False)
        try:
            restarted.report("running")
            began = time.monotonic()
            # Its deadline is the service timeout (60 s) and more; the new incarnation gives it up at once.
            assert learner.finish_checkpoint(wait=True) is False and not learner.checkpoint_pending
            assert time.monotonic() - began < 30.0
            assert "the replay service restarted before writing it" in caplog.text
            assert not (tmp_path / "checkpoints" / str(learner.steps)).exists()
            # The next checkpoint goes to the new incarnation and is written.
            stop = threading.Event()
            served = restarted.serve_in_thread(stop)
            try:
                learner.step()
                assert learner.checkpoint(wait=True)
            finally:
                stop.set()
                served.join()
        finally:
            restarted.stop()


@pytest.mark.process
@pytest.mark.timeout(300)
def test_sgd_goes_on_while_the_service_writes_a_checkpoint_which_keeps_the_state_of_its_step(tmp_path, monkeypatch):
    import jax

    from actorq_jax.launch import learner as learner_module

    with dqn_service_learner_actor(tmp_path) as (service, learner, actor):
        while learner.items() < 60:
            actor.run_episode()
        while learner.step() is None:
            pass
        # A large table: the service's write lasts until the test lets it go on.
        release, real_checkpoint = threading.Event(), service.server.checkpoint

        def slow_checkpoint(name):
            assert release.wait(60)
            return real_checkpoint(name)

        monkeypatch.setattr(service.server, "checkpoint", slow_checkpoint)
        monkeypatch.setattr(learner_module, "CHECKPOINT_POLL_S", 0.0)  # every look goes to the service
        stop = threading.Event()
        served = service.serve_in_thread(stop)
        try:
            asked_at, state_then = learner.steps, learner.state
            assert learner.checkpoint(wait=False) is False and learner.checkpoint_pending
            taken = 0
            while taken < 5:  # SGD goes on meanwhile
                taken += learner.step() is not None
            assert learner.steps == asked_at + 5
            assert learner.finish_checkpoint(wait=False) is False and learner.checkpoint_pending
            assert not (tmp_path / "checkpoints" / str(asked_at)).exists()
            release.set()
            assert learner.finish_checkpoint(wait=True) and not learner.checkpoint_pending
        finally:
            release.set()
            stop.set()
            served.join()
        counters = read_counters(tmp_path / "checkpoints")
        assert counters["learner_steps"] == asked_at and counters["replay_checkpoint"] == f"step_{asked_at}"
        assert (service.server.checkpoint_dir / f"step_{asked_at}" / "DONE").exists()
        # The saved state is the one of the step asked for, not the one SGD reached since.
        restored, _ = learner.checkpointer.restore(learner.state)
        assert int(restored.steps) == asked_at
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(restored),
                                                        jax.tree_util.tree_leaves(state_then)))


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_stopping_actor_whose_last_items_the_limiter_holds_says_so_and_warns_of_no_loss(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="actorq_jax.launch.actor")
    with dqn_service_learner_actor(tmp_path, rate_limiter="ratio") as (service, learner, actor):
        acting = threading.Thread(target=lambda: [None for _ in iter(actor.run_episode, None)])
        acting.start()
        try:
            # Nothing samples: once past its start-up allowance, the ratio limiter holds the actor's inserts.
            sizes = [learner.items()]
            while len(sizes) < 4 or sizes[-1] != sizes[-4] or sizes[-1] < 50:
                time.sleep(0.5)
                sizes.append(learner.items())
                assert acting.is_alive() and len(sizes) < 120, sizes
        finally:
            actor.stop.set()  # what a run's end does
            acting.join(60)
        assert not acting.is_alive()
        actor.close()
    records = [r for r in caplog.records if r.name == "actorq_jax.launch.actor"]
    assert any(r.levelno == logging.INFO and "stay out of its table" in r.getMessage() for r in records), \
        [r.getMessage() for r in records]
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def _cut(path: Path) -> None:
    """Cuts a file to its first 100 bytes, as a full disk or a copy stopped half way leaves it."""
    path.write_bytes(path.read_bytes()[:100])


@pytest.mark.process
@pytest.mark.timeout(240)
def test_a_replay_checkpoint_that_does_not_read_back_is_passed_over_and_kept_aside(tmp_path, caplog):
    from actorq_jax.launch.replay_service import ReplayService

    with dqn_service_learner_actor(tmp_path) as (service, learner, actor):
        stop = threading.Event()
        served = service.serve_in_thread(stop)
        try:
            sizes = []
            for _ in range(2):  # two checkpoints, the table bigger at the second
                for _ in range(3):
                    actor.run_episode()
                while learner.step() is None:
                    pass
                assert learner.checkpoint(wait=True)
                sizes.append(learner.items())
        finally:
            stop.set()
            served.join()
        older, newer = (c["replay_checkpoint"] for c in learner.checkpointer.kept_counters())
        # Each service on a port of its own: a gRPC connection of this process to a stopped server's port can
        # fail the first call to the next server there ("Socket closed"); a worker process does not have one.
        run = dataclasses.replace(service.run, port=0)
        service.stop()
        replay_dir = tmp_path / "replay_checkpoints"
        # Reverb reads a cut items file as a shorter one; unchecked, the table's counts would let a sampler at it.
        _cut(replay_dir / newer / "items.tfrecord")
        restarted = ReplayService(learner.builder, run, tmp_path, "{}", resume=True)
        try:
            assert restarted.restored == {"checkpoint": older, "items": sizes[0], "unreadable": [newer]}
        finally:
            restarted.stop()
        assert (replay_dir / f"{newer}.unreadable" / "DONE").exists() and not (replay_dir / newer).exists()
        # None left that reads back (a damaged chunk file this time): the table starts empty, the learner's
        # state being its own, and nothing is deleted.
        (replay_dir / older / "chunks.tfrecord").write_bytes(b"not a record")
        empty = ReplayService(learner.builder, run, tmp_path, "{}", resume=True)
        try:
            assert empty.restored == {"checkpoint": None, "items": 0, "unreadable": [older]}
        finally:
            empty.stop()
        assert {p.name for p in replay_dir.iterdir()} >= {f"{older}.unreadable", f"{newer}.unreadable"}
        # Each found before Reverb loads it, and said in one line without TensorFlow's wrapping.
        said = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
        assert len(said) == 2 and "items in its items file where its counts record" in said[0], said
        assert not any("{{" in line or "[Op:" in line or "\n" in line for line in said), said
        # A checkpoint pruned later keeps what was set aside.
        from actorq_jax.replay.server import prune_checkpoints

        prune_checkpoints(replay_dir, keep=[])
        assert {p.name for p in replay_dir.iterdir()} == {"reverb", f"{older}.unreadable", f"{newer}.unreadable"}


def _listening_ports(pid: int) -> set:
    return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def _finish(proc) -> str:
    """SIGTERMs the launcher and returns its output once it exited 0."""
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    return output


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.timeout(360)
def test_pinned_service_outlives_a_learner_kill_and_actors_keep_inserting(tmp_path):
    results = tmp_path / "run"
    # min_size: actors run free, so a learner that is down does not hold them.
    proc = start_run(results, *TINY, "--rate_limiter", "min_size", "--max_times_sampled", "8",
                     "--layout", "pinned", "--max_seconds", "200")
    try:
        learner_pid = wait_for(lambda: status(results).get("learner_steps", 0) >= 10 and status(results)["pid"],
                               120, "the learner's first steps", proc)
        service = status(results, "replay")
        port = int(service["local_address"].rpartition(":")[2])
        # The service listens on the run's port; the learner listens on nothing.
        assert port in _listening_ports(service["pid"])
        assert _listening_ports(learner_pid) == set()
        launcher = psutil.Process(proc.pid)
        wait_for(lambda: worker_process(launcher, "evaluator") and worker_process(launcher, "actor", 1), 60,
                 "actors and evaluator", proc)
        # --layout pinned: the learner alone on the first core, every other role on the rest.
        cores = sorted(os.sched_getaffinity(0))
        expected = {"learner": {cores[0]}, "replay": set(cores[1:])}
        for role in ("replay", "learner", "actor", "evaluator"):
            pid, want = worker_process(launcher, role).pid, expected.get(role, set(cores[1:]))
            wait_for(lambda pid=pid, want=want: os.sched_getaffinity(pid) == want, 30, f"the {role}'s cores")

        before = status(results, "replay")["env_steps"]
        os.kill(learner_pid, signal.SIGKILL)
        seen_while_down = []

        def learner_back():
            report = status(results)
            if report.get("pid") == learner_pid:
                seen_while_down.append(status(results, "replay").get("env_steps", 0))
            return report.get("pid") not in (None, learner_pid) and report.get("phase") == "running"

        wait_for(learner_back, 120, "the restarted learner", proc)
        assert max(seen_while_down) > before, (before, seen_while_down)
        after = status(results, "replay")
        assert after["pid"] == service["pid"], "the service was restarted with the learner"
        restored = status(results)["restored"]
        # The restarted learner samples the live table, not a checkpoint's copy of it.
        assert restored["items"] >= before
        steps = status(results)["learner_steps"]
        wait_for(lambda: status(results)["learner_steps"] > steps, 120, "learner steps after the restart", proc)
    finally:
        output = _finish(proc) if proc.poll() is None else proc.communicate()[0]
        stop_all(proc)
    summary = json.loads((results / "summary.json").read_text())
    assert summary["learner_restarts"] == 1 and summary["replay_restarts"] == 0, output


@pytest.mark.process
@pytest.mark.timeout(240)
def test_killed_service_comes_back_on_its_port_with_its_items_and_nobody_else_restarts(tmp_path):
    results = tmp_path / "run"
    proc = start_run(results, *TINY, "--max_seconds", "200", "--server_timeout_s", "60")
    try:
        counters = wait_for(lambda: (read_counters(results / "checkpoints") or {}).get("replay_checkpoint")
                            and read_counters(results / "checkpoints"), 150, "a learner checkpoint", proc)
        launcher = psutil.Process(proc.pid)
        wait_for(lambda: worker_process(launcher, "actor", 1), 60, "the actors", proc)
        learner = worker_process(launcher, "learner")
        actors = [worker_process(launcher, "actor", i) for i in range(2)]
        service = status(results, "replay")
        # Held while the service is down and comes back (its silence does not count meanwhile): it publishes
        # nothing into the restored tables before this test reads them.
        learner.suspend()
        try:
            os.kill(service["pid"], signal.SIGKILL)
            back = wait_for(lambda: status(results, "replay").get("pid") not in (None, service["pid"])
                            and status(results, "replay"), 120, "the restarted service", proc)
            # The checkpoint's policies, older than the learner's last publications, are not served.
            tables = reverb.Client(back["local_address"]).server_info(timeout=10)
            assert [tables[t].current_size for t in (VARIABLES_TABLE, EVAL_VARIABLES_TABLE)] == [0, 0]
        finally:
            learner.resume()
        assert back["local_address"] == service["local_address"]
        # The run's env-step count goes on from where it was (the items since the checkpoint are lost, not the steps).
        assert back["env_steps"] >= service["env_steps"]
        # Restored from the replay checkpoint of the learner's newest checkpoint (or a newer pair).
        name = back["restored"]["checkpoint"]
        assert name and int(name.rpartition("_")[2]) >= counters["learner_steps"]
        table = "replay"
        assert back["restored"]["items"] == checkpoint_table_size(results / "replay_checkpoints", name, table) > 0
        steps = status(results)["learner_steps"]
        # The learner and the actors reconnect on their own: same processes, and training goes on.
        wait_for(lambda: status(results)["learner_steps"] >= steps + 50, 120, "learner steps after the service restart",
                 proc)
        assert learner.is_running() and worker_process(launcher, "learner").pid == learner.pid
        assert all(a.is_running() for a in actors)
        env_steps = status(results, "replay")["env_steps"]
        wait_for(lambda: status(results, "replay")["env_steps"] > env_steps, 60, "inserts into the restored table", proc)
    finally:
        output = _finish(proc) if proc.poll() is None else proc.communicate()[0]
        stop_all(proc)
    summary = json.loads((results / "summary.json").read_text())
    assert summary["replay_restarts"] == 1 and summary["learner_restarts"] == 0, output
    assert "replay service back on port" in output
    # A checkpoint asked of the killed service (if one was pending) was given up when the new one reported,
    # not after the request's 60 s timeout, which would have held SGD and, through the limiter, the actors.
    assert "did not write one in time" not in (results / "logs" / "learner.log").read_text()
    # The restored tables held the policy of the checkpoint's time, older than what the live learner had
    # published: nobody went back to it (each actor's policy versions, the evaluations' learner steps).
    evaluated = [r["learner_steps"] for r in rows(results / "eval.csv")]
    assert evaluated == sorted(evaluated), evaluated
    for i in range(2):
        episodes = rows(results / "actors" / f"actor_{i}.csv")
        versions = [r["params_version"] for r in episodes]
        assert versions == sorted(versions), (i, versions)


# The launcher's run, with the dead service's port taken (by this wrapper, standing for another process) just
# before the launcher restarts the service: the restart finds it taken, as one racing another program would.
_PORT_STOLEN = """
import socket, sys
from actorq_jax.launch.launcher import Launcher, run_experiment
held = []
restart_service = Launcher._restart_service
def steal_then_restart(self, replay):
    if not held:
        thief = socket.socket()
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the dead service's connections linger
        thief.bind(("127.0.0.1", self.run.port))
        thief.listen(1)
        held.append(thief)
    return restart_service(self, replay)
Launcher._restart_service = steal_then_restart
sys.exit(run_experiment("d4pg", sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.timeout(400)
def test_a_service_that_comes_back_at_a_new_address_is_followed_by_the_learner_and_actors(tmp_path):
    results = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _PORT_STOLEN, *TINY, "--num_actors", "1", "--max_seconds", "200",
                             "--results_dir", str(results)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        counters = wait_for(lambda: (read_counters(results / "checkpoints") or {}).get("replay_checkpoint")
                            and read_counters(results / "checkpoints"), 150, "a learner checkpoint", proc)
        wait_for(lambda: rows(results / "actors" / "actor_0.csv"), 150, "actor 0's first episode", proc)
        service, learner = status(results, "replay"), status(results)
        os.kill(service["pid"], signal.SIGKILL)
        back = wait_for(lambda: status(results, "replay").get("pid") not in (None, service["pid"])
                        and status(results, "replay").get("phase") == "running" and status(results, "replay"),
                        150, "the service at its new port", proc)
        port = json.loads((results / "config.json").read_text())["run"]["port"]
        assert back["local_address"] == f"127.0.0.1:{port}" != service["local_address"]
        assert back["restored"]["checkpoint"] and back["restored"]["items"] > 0
        # The learner restarted at the new address from its checkpoint (it could not reach the old one) and trains.
        moved = wait_for(lambda: status(results).get("pid") not in (None, learner["pid"])
                         and status(results).get("restored") and status(results), 150, "the learner at the new port",
                         proc)
        assert moved["restored"]["learner_steps"] >= counters["learner_steps"]
        wait_for(lambda: status(results).get("learner_steps", 0) >= moved["restored"]["learner_steps"] + 50, 120,
                 "learner steps at the new port", proc)
        env_steps = status(results, "replay")["env_steps"]
        wait_for(lambda: status(results, "replay")["env_steps"] > env_steps, 90, "the actor's inserts at the new port",
                 proc)
        # Rows are written as episodes end: the run goes on until the restarted actor has finished one.
        wait_for(lambda: len({r["incarnation"] for r in rows(results / "actors" / "actor_0.csv")}) == 2, 120,
                 "an episode of actor 0 at the new port", proc)
    finally:
        output = _finish(proc) if proc.poll() is None else proc.communicate()[0]
        stop_all(proc)
    summary = json.loads((results / "summary.json").read_text())
    # Following the service is no failure of the learner or the actor: no restart budget spent.
    assert summary["replay_restarts"] == 1 and summary["learner_restarts"] == 0, output
    assert any(f"was taken while the replay service restarted; starting it on port {port}" in e
               for e in summary["events"]), summary["events"]
    assert any(e.startswith(f"the replay service moved from {service['local_address']} to 127.0.0.1:{port}")
               for e in summary["events"]), summary["events"]
    assert not any(" died " in e and e.startswith(("actor_0", "evaluator")) for e in summary["events"]), output
    env = [r["env_steps"] for r in rows(results / "learner.csv")]
    assert env == sorted(env)
    incarnations = {r["incarnation"] for r in rows(results / "actors" / "actor_0.csv")}
    assert len(incarnations) == 2  # actor 0's episodes before the move and after it, in one file


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_service_worker_binds_the_port_its_launcher_passes_not_the_one_its_config_was_written_with(tmp_path):
    # Under Ray a host keeps the config.json it started with; a port picked again since reaches it as --port.
    from actorq_jax.launch.config import save_config
    from actorq_jax.launch.runtime import free_port

    results = tmp_path / "run"
    run, agent_config = parse_run("d4pg", [*TINY, "--results_dir", str(results)])
    stale, port = free_port(), free_port()
    results.mkdir()
    save_config(results / "config.json", dataclasses.replace(run, port=stale), agent_config)
    worker = subprocess.Popen([sys.executable, "-m", "actorq_jax.launch.worker", "replay", "--results_dir",
                               str(results), "--port", str(port)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        report = wait_for(lambda: status(results, "replay").get("address") and status(results, "replay"), 90,
                          "the service's report", worker)
        assert report["local_address"] == f"127.0.0.1:{port}"
    finally:
        worker.send_signal(signal.SIGTERM)
        output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, output[-2000:]


@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_service_that_stalls_for_seconds_costs_the_actor_no_episode(tmp_path):
    # A replay checkpoint of a large table stops the service answering for seconds; SIGSTOP does the same.
    results = tmp_path / "run"
    proc = start_run(results, *TINY, "--num_actors", "1", "--max_seconds", "200")
    actor_csv, actor_log = results / "actors" / "actor_0.csv", results / "logs" / "actor_0.log"
    try:
        launcher = psutil.Process(proc.pid)
        wait_for(lambda: rows(actor_csv), 150, "actor 0's first episode", proc)
        actor = worker_process(launcher, "actor", 0)
        service = status(results, "replay")
        os.kill(service["pid"], signal.SIGSTOP)
        try:
            wait_for(lambda: "does not answer" in actor_log.read_text(), 60, "the actor noticing the stall", proc)
            time.sleep(2.0)
        finally:
            os.kill(service["pid"], signal.SIGCONT)
        wait_for(lambda: "answers again and took our items" in actor_log.read_text(), 60, "the actor going on", proc)
        episodes = len(rows(actor_csv))
        wait_for(lambda: len(rows(actor_csv)) >= episodes + 2, 120, "episodes after the stall", proc)
        assert worker_process(launcher, "actor", 0).pid == actor.pid  # the same process went on
    finally:
        output = _finish(proc) if proc.poll() is None else proc.communicate()[0]
        stop_all(proc)
    assert "reconnecting" not in actor_log.read_text(), actor_log.read_text()[-3000:]
    # No episode was abandoned: every row is a whole cartpole_balance episode, the one across the stall included.
    assert {r["episode_length"] for r in rows(actor_csv)} == {1000}, output[-2000:]


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_service_stopped_for_good_is_killed_and_restarted_and_its_clients_go_on(tmp_path):
    # SIGSTOP without SIGCONT: alive to the launcher, gone to everyone else (a hung process looks the same).
    results = tmp_path / "run"
    proc = start_run(results, *TINY, "--num_actors", "1", "--max_seconds", "250")
    stopped = None
    try:
        launcher = psutil.Process(proc.pid)
        wait_for(lambda: read_counters(results / "checkpoints"), 150, "a first checkpoint", proc)
        learner = worker_process(launcher, "learner")
        stopped = psutil.Process(status(results, "replay")["pid"])  # psutil knows it from a later process of its pid
        stopped.suspend()
        stopped_at = time.monotonic()
        wait_for(lambda: status(results, "replay").get("pid") not in (None, stopped.pid)
                 and status(results, "replay").get("phase") == "running", 120, "the service's restart", proc)
        took = time.monotonic() - stopped_at
        steps = status(results).get("learner_steps", 0)
        wait_for(lambda: status(results).get("learner_steps", 0) >= steps + 50, 120, "learner steps after it", proc)
        assert worker_process(launcher, "learner").pid == learner.pid  # it reconnected: no restart of its own
    finally:
        try:
            output = _finish(proc) if proc.poll() is None else proc.communicate()[0]
        finally:
            stop_all(proc)
            if stopped is not None and stopped.is_running():
                stopped.kill()  # a test that failed early leaves no stopped process behind
    # Silent for half of --server_timeout_s (60 s by default), then killed and restarted from its checkpoint:
    # back well inside the window its clients reconnect for. (The silence counts from the last report the launcher
    # read, up to a second before the stop, and a forked service restarts in about one: hence 25, not 30.)
    assert "the replay service has not reported for" in output and "killing it" in output, output[-3000:]
    assert 25 <= took < 60, f"the service came back {took:.0f} s after it stopped"
    summary = json.loads((results / "summary.json").read_text())
    assert summary["replay_restarts"] == 1 and summary["exit_code"] == 0
    assert not any(e.startswith(("learner died", "actor_0 died")) for e in summary["events"]), summary["events"]


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_learner_an_actor_and_the_evaluator_stopped_for_good_are_killed_and_restarted(tmp_path):
    # SIGSTOP without SIGCONT: the processes are alive, and neither SGD steps, env steps nor evaluations come
    # from them (a hung one looks the same). All at once, as a frozen machine would.
    results = tmp_path / "run"
    proc = start_run(results, *TINY, "--num_actors", "1", "--server_timeout_s", "5", "--max_seconds", "250")
    stopped = []
    try:
        launcher = psutil.Process(proc.pid)
        wait_for(lambda: read_counters(results / "checkpoints"), 150, "a first checkpoint", proc)
        # Past its first SGD call (which compiles the step), it asks for no more silence than its waits need;
        # the evaluator likewise once each of its policies ran an episode.
        wait_for(lambda: 0 < status(results).get("quiet_s", 0) < 60, 60, "the learner's compiled step", proc)
        wait_for(lambda: 0 < status(results, "evaluator").get("quiet_s", 0) < 60, 60, "timed evaluations", proc)
        report, evaluator = status(results), status(results, "evaluator")
        allowed, evaluator_allowed = report["quiet_s"], evaluator["quiet_s"]
        stopped = [psutil.Process(report["pid"]), worker_process(launcher, "actor", actor_id=0),
                   psutil.Process(evaluator["pid"])]
        for process in stopped:
            process.suspend()
        stopped_at = time.monotonic()
        # Each restart is timed on its own: one that comes late (the actor's, under load) must not push back another's.
        seen = first_seen({"learner": lambda: status(results).get("pid") not in (None, stopped[0].pid),
                           "actor_0": lambda: worker_process(launcher, "actor", actor_id=0, restart=1),
                           "evaluator": lambda: worker_process(launcher, "evaluator", restart=1)},
                          stopped_at, 120, proc)
        took, actor_took, evaluator_took = seen["learner"], seen["actor_0"], seen["evaluator"]
        restored = status(results)["learner_steps"]
        wait_for(lambda: status(results).get("learner_steps", 0) >= restored + 20, 120, "SGD steps after it", proc)
    finally:
        try:
            output = _finish(proc) if proc.poll() is None else proc.communicate()[0]
        finally:
            stop_all(proc)
            for process in stopped:
                if process is not None and process.is_running():
                    process.kill()  # a test that failed early leaves no stopped process behind
    assert "the learner has not reported for" in output and "killing it" in output, output[-3000:]
    # Killed once the silence its last report allowed (2 x 5 s of waits and a 15 s margin) ran out; the
    # restart restores a checkpoint and compiles again, well inside a minute here.
    assert 25 <= allowed < 30 and allowed - 2 <= took < allowed + 60, (allowed, took)
    # The actor's lease stays held until it expires (its 10 s life, from the last renewal), then 30 s more.
    assert "actor_0 has not renewed its id lease for" in output, output[-3000:]
    assert 25 <= actor_took < 60, actor_took
    # The evaluator's allowance: a fetch, four times its longest episode so far, a margin.
    assert "the evaluator has not reported for" in output, output[-3000:]
    assert evaluator_allowed - 2 <= evaluator_took < evaluator_allowed + 15, (evaluator_allowed, evaluator_took)
    summary = json.loads((results / "summary.json").read_text())
    assert summary["learner_restarts"] == 1 and summary["replay_restarts"] == 0 and summary["exit_code"] == 0
    for name in ("actor_0", "evaluator"):
        assert any(e.startswith(f"{name} died") and "restart 1/" in e for e in summary["events"]), summary["events"]
    # The restarted evaluator evaluated: rows from after the stop, the final evaluation among them.
    assert any(int(r["final"]) == 1 for r in rows(results / "eval.csv")), output[-3000:]


@pytest.mark.parametrize("flag, learner", [("auto", None), ("cpu", "cpu"), ("gpu", "cuda")])
def test_every_role_but_the_learner_runs_jax_on_the_cpu(flag, learner):
    from actorq_jax.launch.runtime import jax_platform

    run = RunConfig(task="cartpole_balance", results_dir="r", learner_platform=flag)
    assert jax_platform("learner", run) == learner
    assert [jax_platform(role, run) for role in ("replay", "actor", "evaluator")] == ["cpu"] * 3


def test_a_worker_process_takes_its_roles_platform(monkeypatch):
    import jax

    from actorq_jax.launch.runtime import apply_jax_platform

    monkeypatch.setenv("JAX_PLATFORMS", "")
    before = jax.config.jax_platforms
    try:
        assert apply_jax_platform("actor", RunConfig(task="cartpole_balance", results_dir="r")) == "cpu"
        assert os.environ["JAX_PLATFORMS"] == "cpu" and jax.config.jax_platforms == "cpu"
        assert jax.default_backend() == "cpu"
    finally:
        jax.config.update("jax_platforms", before)


def test_periods_count_a_multiple_stepped_over_by_a_multi_step_call():
    from actorq_jax.launch.learner import crossed

    assert [crossed(b, b + 4, 10) for b in (0, 4, 8, 12, 16, 20)] == [False, False, True, False, True, False]
    assert crossed(9, 10, 10) and not crossed(10, 11, 10)


@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_learner_of_several_steps_per_call_trains_and_writes_back_every_priority(tmp_path):
    with dqn_service_learner_actor(tmp_path, sgd_steps_per_call=4) as (_, learner, actor):
        while learner.items() < 60:
            actor.run_episode()
        metrics = None
        while metrics is None:
            metrics = learner.step()
        # One call made four steps; the metrics are the last step's (a batch of priorities, one per item).
        assert learner.steps == 4 and np.shape(metrics["priorities"]) == (16,)
        assert learner.feedback.max_priority > 1.0
        learner.step()
        assert learner.steps == 8


@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_stopped_service_is_waited_for_within_the_timeout_and_given_up_past_it(tmp_path):
    results = tmp_path / "run"
    proc = start_run(results, *TINY, "--num_actors", "1", "--server_timeout_s", "8", "--max_seconds", "250")
    try:
        wait_for(lambda: status(results).get("learner_steps", 0) >= 20, 150, "the learner's first steps", proc)
        launcher = psutil.Process(proc.pid)
        learner, actor = worker_process(launcher, "learner"), worker_process(launcher, "actor", 0)
        service = psutil.Process(status(results, "replay")["pid"])
        # A server that stops answering without dying, for less than the timeout: everyone waits, nobody exits.
        service.suspend()
        time.sleep(3)
        service.resume()
        steps = status(results)["learner_steps"]
        wait_for(lambda: status(results)["learner_steps"] > steps, 120, "learner steps after the pause", proc)
        env_steps = status(results, "replay")["env_steps"]
        wait_for(lambda: status(results, "replay")["env_steps"] > env_steps, 60, "inserts after the pause", proc)
        assert actor.is_running() and worker_process(launcher, "actor", 0, restart=1) is None
        # Past the timeout: the actor says so in one line and exits non-zero (the launcher then restarts it).
        service.suspend()
        time.sleep(14)
        service.resume()
        wait_for(lambda: worker_process(launcher, "actor", 0, restart=1), 60, "actor 0's restart", proc)
        assert learner.is_running() and worker_process(launcher, "learner").pid == learner.pid
        steps = status(results)["learner_steps"]
        wait_for(lambda: status(results)["learner_steps"] > steps, 120, "learner steps after the long pause", proc)
    finally:
        output = _finish(proc) if proc.poll() is None else proc.communicate()[0]
        stop_all(proc)
    log = (results / "logs" / "actor_0.log").read_text()
    lines = [line for line in log.splitlines() if "unreachable for" in line]
    assert len(lines) == 1 and "replay service at 127.0.0.1:" in lines[0] and "server_timeout_s 8" in lines[0], log[-2000:]
    summary = json.loads((results / "summary.json").read_text())
    assert any(e.startswith("actor_0 died (exit code 3)") for e in summary["events"]), output
