"""`--launcher ray`: the same run placed on Ray nodes, every node and server on 127.0.0.1.

A `ray.cluster_utils.Cluster` (a head and worker nodes with custom resources)
stands in for a cluster; with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 every node
binds 127.0.0.1, so no test traffic leaves loopback. Ray's token
authentication stays on (its default). The runs go through the run scripts,
as a user's would; the driver writes the results directory from what the
nodes send.
"""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Set

import psutil
import pytest
from launch_support import ENV, RAY_SETTINGS, ROOT, TINY, TINY_DQN, alive, rows, start_remote_actor, status, stop_all, usage_error

from actorq_jax.launch.flags import parse_run
from actorq_jax.launch.ray_flags import parse_resources, placement_problems, ray_flag_problems

# One Ray instance at a time on this machine: under pytest-xdist these tests share one worker.
pytestmark = pytest.mark.xdist_group("ray")

# Loopback only, and token authentication on with a token of this test run (no file in $HOME needed).
RAY_ENV = {**ENV, **RAY_SETTINGS}
# Every file a local run leaves (checkpoint trees checked apart).
RESULT_FILES = ("config.json", "summary.json", "learner.csv", "eval.csv", "emissions.csv", "status/learner.json",
                "logs/learner.log", "logs/evaluator.log")


# -- flags ---------------------------------------------------------------------------------


def _run(**fields):
    values = {"launcher": "ray", "ray_address": "", "learner_resources": "", "replay_resources": "", "actor_resources": "",
              "advertise_host": "", "num_actors": 2}
    values.update(fields)
    return SimpleNamespace(**values)


def test_resource_lists_parse():
    assert parse_resources("") == {}
    assert parse_resources("GPU=1, CPU=0.5,actor_node=1") == {"GPU": 1.0, "CPU": 0.5, "actor_node": 1.0}


@pytest.mark.parametrize("text, says", [("GPU", "NAME=AMOUNT"), ("CPU=x", "number"), ("CPU=0", "positive"),
                                        ("CPU=1,CPU=2", "twice"), ("=1", "NAME=AMOUNT")])
def test_bad_resource_lists_are_named(text, says):
    with pytest.raises(ValueError, match=says):
        parse_resources(text)
    problems = ray_flag_problems(_run(actor_resources=text))
    assert problems and problems[0][0] == "actor_resources" and says in problems[0][1]


def test_resources_no_node_has_are_named():
    nodes = [{"CPU": 2.0, "GPU": 0.0}, {"CPU": 1.0, "actor_node": 2.0}]
    assert placement_problems({"CPU": 1}, {"actor_node": 1}, 2, nodes) == []
    (flag, message), = placement_problems({"GPU": 1}, {}, 2, nodes)
    assert flag == "learner_resources" and "lacking: GPU" in message
    (flag, message), = placement_problems({}, {"actor_node": 1}, 3, nodes)  # room for two actors only
    assert flag == "actor_resources" and "--num_actors 3" in message
    (flag, message), = placement_problems({}, {"CPU": 2, "actor_node": 1}, 1, nodes)  # each exists, never together
    assert flag == "actor_resources" and "all at once" in message


def test_unreachable_ray_address_is_named():
    (flag, message), = ray_flag_problems(_run(ray_address=f"127.0.0.1:{_closed_port()}"))
    assert flag == "ray_address" and "nothing answers" in message
    (flag, message), = ray_flag_problems(_run(ray_address="no-port-here"))
    assert flag == "ray_address" and "HOST:PORT" in message


def test_ray_flags_need_the_ray_launcher():
    assert ray_flag_problems(_run(launcher="local")) == []
    problems = ray_flag_problems(_run(launcher="local", ray_address="auto", actor_resources="CPU=1"))
    assert {flag for flag, _ in problems} == {"ray_address", "actor_resources"}
    assert ray_flag_problems(_run(launcher="slurm"))[0][0] == "launcher"


def _closed_port() -> int:
    with socket.socket() as sock:  # bound, never listening: nothing answers there
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("flags, named, says", [
    (["--ray_address", "127.0.0.1:{port}"], "--ray_address", "nothing answers"),
    (["--actor_resources", "CPU"], "--actor_resources", "NAME=AMOUNT"),
    (["--learner_resources", "accelerator_node=1"], "--learner_resources", "lacking: accelerator_node"),
])
def test_bad_ray_flags_exit_2_naming_the_flag(flags, named, says, tmp_path, capsys):
    flags = [f.format(port=_closed_port()) for f in flags]
    err = usage_error(capsys, lambda: parse_run("d4pg", ["--launcher", "ray", *flags, "--results_dir", str(tmp_path / "run")]))
    assert named in err and says in err, err[-2000:]
    assert not (tmp_path / "run").exists()  # nothing started


# -- runs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_environment():
    """RAY_SETTINGS in this process's environment while the module's runs and Cluster are up."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in RAY_SETTINGS.items():
            patch.setenv(name, value)
        yield


class Descendants:
    """Every process that descends from some roots while it watches (the run's workers, Ray's daemons)."""

    def __init__(self, roots: List[int]):
        self.roots = roots
        self.seen: Dict[int, str] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.wait(0.5):
            for root in self.roots:
                try:
                    children = psutil.Process(root).children(recursive=True)
                except psutil.Error:
                    continue
                for child in children:
                    # Read again on every pass: a child caught between fork and exec (Ray runs Python in
                    # preexec_fn there) still shows its parent's command line. One that is exiting reads
                    # empty and keeps what was seen; one that is gone stops no other.
                    try:
                        words = child.cmdline()
                    except psutil.Error:
                        continue
                    if words:
                        self.seen[child.pid] = " ".join(words[:4])

    def workers(self) -> Set[int]:
        """Pids of the run's worker processes seen so far."""
        return {pid for pid, cmd in self.seen.items() if "actorq_jax.launch.worker" in cmd}

    def close(self) -> Dict[int, str]:
        """Stops watching; the processes seen."""
        self.stop.set()
        self.thread.join()
        return dict(self.seen)


def _launch(results: Path, *flags: str, script: str = "experiments/run_d4pg.py") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, script, *flags, "--launcher", "ray", "--results_dir", str(results)],
                            cwd=ROOT, env=RAY_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout_s: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the run did not finish in {timeout_s:.0f} s:\n{out[-3000:]}") from None
    assert proc.returncode == 0, out[-3000:]
    return out


def _assert_complete(results: Path, num_actors: int) -> dict:
    for name in RESULT_FILES + tuple(f"actors/actor_{i}.csv" for i in range(num_actors)):
        assert (results / name).exists(), name
    for tree, finished in (("checkpoints", "counters/metadata"), ("replay_checkpoints", "DONE")):
        steps = list((results / tree).iterdir())
        assert steps and all((step / finished).exists() for step in steps), (tree, steps)
    summary = json.loads((results / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["counters_from"] == "final status report"
    assert summary["energy_kwh"] > 0
    assert any(r["final"] == 1 for r in rows(results / "eval.csv"))
    for i in range(num_actors):
        assert rows(results / "actors" / f"actor_{i}.csv"), f"actor_{i}.csv has no episode"
    return summary


@pytest.mark.process
@pytest.mark.timeout(300)
def test_dqn_on_a_local_ray_instance_stops_on_sigterm_and_leaves_no_process(tmp_path):
    results = tmp_path / "run"
    proc = _launch(results, *TINY_DQN, "--num_actors", "1", "--envs_per_actor", "2",
                   # The test stops it: a budget past the test's deadline never ends the run before the test looks.
                   "--max_seconds", "400",
                   "--eval_period", "100", "--checkpoint_period", "200", script="experiments/run_dqn.py")
    seen = Descendants([proc.pid])
    remote = None
    try:
        deadline = time.monotonic() + 180  # about 40 s on a quiet machine; a loaded one needs more
        while not status(results, "replay").get("local_address"):
            assert proc.poll() is None and time.monotonic() < deadline, "the replay service did not start"
            time.sleep(0.5)
        # A hand-started actor, outside Ray: its rows take the replay service's road to the driver too.
        remote = start_remote_actor(status(results, "replay")["local_address"], tmp_path / "remote", "--actor_id", "7",
                                    "--max_episodes", "2")
        # Stopped once the learner has logged and checkpointed, and episodes reached the driver.
        while (status(results).get("learner_steps", 0) < 250 or not rows(results / "actors" / "actor_0.csv")
               or remote.poll() is None):
            assert proc.poll() is None and time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out = _finish(proc, 100)
    finally:
        processes = seen.close()
        stop_all(proc, remote)
    assert "stop requested" in out
    summary = _assert_complete(results, 1)  # stopped in order: final checkpoint, final evaluation, every file
    assert summary["launcher"] == "ray" and summary["env_steps"] > 0
    assert {r["env_index"] for r in rows(results / "actors" / "actor_0.csv")} == {0, 1}  # both of its environments
    assert remote.returncode == 0 and len(rows(tmp_path / "remote" / "actor_7.csv")) == 2
    assert rows(results / "actors" / "actor_7.csv") == rows(tmp_path / "remote" / "actor_7.csv")
    assert any("raylet" in cmd for cmd in processes.values()), "no local Ray instance was started"
    assert seen.workers(), "no worker process ran under Ray"
    deadline = time.monotonic() + 20
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(processes), {p: processes[p] for p in alive(processes)}


@pytest.fixture(scope="module")
def cluster(ray_environment):
    """A head (the learner's and the replay service's node) and two actor nodes, all on 127.0.0.1."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"learner_node": 1, "service_node": 1},
                                                         "node_ip_address": "127.0.0.1"})
    workers = [nodes.add_node(num_cpus=1, resources={"actor_node": 2}, node_ip_address="127.0.0.1") for _ in range(2)]
    nodes.wait_for_nodes()
    yield nodes, workers
    nodes.shutdown()


def _node_of_worker(workers, role_args: List[str]):
    """The cluster node whose raylet runs the worker process with these arguments."""
    for node in workers:
        raylet = node.all_processes["raylet"][0].process.pid
        for child in psutil.Process(raylet).children(recursive=True):
            try:
                cmd = child.cmdline()
            except psutil.Error:
                continue
            if "actorq_jax.launch.worker" in cmd and all(a in cmd for a in role_args):
                return node
    return None


def _cluster_run(nodes, results: Path, actor_node: int, env_steps: int) -> subprocess.Popen:
    """Two actors needing `actor_node` each (2 fills an actor node), the learner and the replay service on the head
    (so that losing an actor node takes actors only, whichever node Ray picked for them)."""
    return _launch(results, *TINY, "--ray_address", nodes.address, "--learner_resources", "learner_node=1",
                   "--replay_resources", "service_node=1", "--actor_resources", f"actor_node={actor_node}", "--num_actors", "2",
                   "--max_env_steps", str(env_steps))


@pytest.mark.process
@pytest.mark.timeout(200)
def test_learner_and_actors_on_separate_nodes(cluster, tmp_path):
    nodes, _ = cluster
    results = tmp_path / "run"
    proc = _cluster_run(nodes, results, actor_node=2, env_steps=2500)
    _finish(proc, 180)
    summary = _assert_complete(results, 2)
    placed = [e for e in summary["events"] if " on node " in e]
    node_of = {e.split(" ", 1)[0]: e.rsplit(" ", 1)[1] for e in placed}
    # actor_node=2 fills a node: one actor per actor node, neither on the learner's.
    assert len({node_of["learner"], node_of["actor_0"], node_of["actor_1"]}) == 3, placed
    # The replay service went where --replay_resources asked (the head); the evaluator, which fetches every
    # published policy from the service's server, goes beside it.
    assert node_of["replay"] == node_of["learner"]
    assert node_of["evaluator"] == node_of["replay"]
    assert status(results)["phase"] == "done"
    # Each of the three nodes measured its own energy: a row each, summed in the summary.
    energy_rows = rows(results / "emissions.csv")
    assert summary["energy_nodes"] == 3 and len(energy_rows) == 3
    assert len({r["project_name"] for r in energy_rows}) == 3
    assert summary["energy_kwh"] == pytest.approx(sum(r["energy_consumed"] for r in energy_rows), rel=1e-6)


@pytest.mark.process
# The module's last test: the cluster's shutdown runs in its teardown, inside this limit, and Ray waits up to 30 s
# for each killed process of a node to be reaped (one in a disk write on a busy host takes that long).
@pytest.mark.timeout(420)
def test_a_lost_node_brings_its_actor_back_on_another(cluster, tmp_path):
    nodes, workers = cluster
    results = tmp_path / "run"
    proc = _cluster_run(nodes, results, actor_node=1, env_steps=5000)
    env_steps: List[int] = []
    try:
        deadline = time.monotonic() + 150
        while not rows(results / "actors" / "actor_0.csv") or not rows(results / "actors" / "actor_1.csv"):
            assert proc.poll() is None and time.monotonic() < deadline, "actors did not write episodes"
            env_steps.append(int(status(results).get("env_steps", 0)))
            time.sleep(0.5)
        victim = _node_of_worker(workers, ["actor", "--actor_id", "0"])
        assert victim is not None, "actor_0's process is on no actor node"
        nodes.remove_node(victim)
        while proc.poll() is None:
            env_steps.append(int(status(results).get("env_steps", 0)))
            time.sleep(0.5)
        out = _finish(proc, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = _assert_complete(results, 2)
    assert any(e.startswith("actor_0 died") and "restart 1/" in e for e in summary["events"]), out[-3000:]
    assert not any(e.startswith(("replay died", "learner died")) for e in summary["events"]), summary["events"]
    assert any(e.startswith("actor_0 (incarnation 1) on node") for e in summary["events"]), summary["events"]
    assert summary["env_steps"] >= 5000
    assert env_steps == sorted(env_steps), "env steps went backwards"
    learner_env_steps = [r["env_steps"] for r in rows(results / "learner.csv")]
    assert learner_env_steps == sorted(learner_env_steps)
    # One header, then the episodes of both incarnations of actor 0.
    text = (results / "actors" / "actor_0.csv").read_text().splitlines()
    assert sum(line.startswith("actor_id") for line in text) == 1
