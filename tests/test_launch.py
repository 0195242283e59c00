"""The launcher end to end: a real learner, Reverb server, actors and evaluator on localhost.

One run serves several tests (it is the expensive part): while it runs, the test
kills an actor, joins a remote actor with --server, and finally stops the run with
SIGTERM; the tests then check the restart, the remote contribution, the results
directory and that no process outlived the run.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "MUJOCO_GL": "disable", "TF_CPP_MIN_LOG_LEVEL": "2"}
TINY = [
    "--task", "cartpole_balance", "--policy_layers", "16,16", "--critic_layers", "32,32",
    "--batch_size", "16", "--min_replay_size", "100", "--samples_per_insert", "4",
    "--publish_period", "5", "--update_period", "50", "--eval_period", "50", "--checkpoint_period", "100",
]


def _wait_for(predicate, timeout_s: float, what: str, proc=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited (code {proc.returncode}) while waiting for {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _rows(path: Path):
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


def _actor_process(launcher: psutil.Process, actor_id: int, restart: int = 0):
    for child in launcher.children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "actorq_jax.launch.worker" in cmd and "actor" in cmd and cmd[cmd.index("--actor_id") + 1] == str(actor_id):
            current = int(cmd[cmd.index("--restart") + 1]) if "--restart" in cmd else 0
            if current == restart:
                return child
    return None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Runs D4PG with 2 actors, kills actor 0, adds a remote actor, then SIGTERMs the launcher."""
    results = tmp_path_factory.mktemp("launch") / "run"
    cmd = [sys.executable, "experiments/run_d4pg.py", *TINY, "--num_actors", "2", "--actor_bits", "8",
           "--max_seconds", "400", "--results_dir", str(results)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launcher = psutil.Process(proc.pid)
    seen = set()
    remote = None
    try:
        status = _wait_for(
            lambda: json.loads((results / "status" / "learner.json").read_text())
            if (results / "status" / "learner.json").exists() else None,
            120, "the learner's address", proc)
        remote_dir = results.parent / "remote"
        remote = subprocess.Popen(
            [sys.executable, "-m", "actorq_jax.launch.actor", "--server", status["local_address"],
             "--actor_id", "7", "--log_dir", str(remote_dir), "--max_episodes", "1"],
            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait_for(lambda: _rows(results / "actors" / "actor_0.csv"), 150, "actor 0's first episode", proc)
        seen.update(p.pid for p in launcher.children(recursive=True))
        victim = _actor_process(launcher, 0)
        assert victim is not None
        victim.kill()
        _wait_for(lambda: _actor_process(launcher, 0, restart=1), 60, "actor 0's restart", proc)
        remote_out, _ = remote.communicate(timeout=150)
        seen.update(p.pid for p in launcher.children(recursive=True))
        _wait_for(lambda: len({r["learner_steps"] for r in _rows(results / "eval.csv")}) >= 2, 120, "two evaluations", proc)
        seen.update(p.pid for p in launcher.children(recursive=True))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        for p in (proc, remote):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    return {"dir": results, "code": proc.returncode, "out": out, "pids": seen, "remote_dir": remote_dir,
            "remote_code": remote.returncode, "remote_out": remote_out}


@pytest.mark.timeout(600)
def test_sigterm_stops_the_run_cleanly_without_orphans(run):
    assert run["code"] == 0, run["out"][-3000:]
    assert len(run["pids"]) >= 4  # learner, two actors, evaluator (and the restarted actor)
    alive = [pid for pid in run["pids"] if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes outlived the run: {alive}"
    assert "stop requested" in run["out"]


@pytest.mark.timeout(600)
def test_killed_actor_is_restarted_and_the_run_goes_on(run):
    summary = json.loads((run["dir"] / "summary.json").read_text())
    assert any(e.startswith("actor_0 died") and "restart 1/3" in e for e in summary["events"])
    assert summary["learner_steps"] > 0 and summary["env_steps"] > 0


@pytest.mark.timeout(600)
def test_remote_actor_contributes_transitions(run):
    assert run["remote_code"] == 0, run["remote_out"][-3000:]
    rows = _rows(run["remote_dir"] / "actor_7.csv")
    assert len(rows) == 1 and int(rows[0]["env_steps"]) == 1000  # one full cartpole episode written to replay
    summary = json.loads((run["dir"] / "summary.json").read_text())
    local_logged = sum(int(r["episode_length"]) for p in (run["dir"] / "actors").glob("actor_*.csv") for r in _rows(p))
    assert summary["env_steps"] >= local_logged + 1000


@pytest.mark.timeout(600)
def test_results_directory_is_complete(run):
    d = run["dir"]
    names = ("config.json", "summary.json", "learner.csv", "eval.csv", "emissions.csv",
             "actors/actor_0.csv", "actors/actor_1.csv")
    for name in names:
        assert (d / name).exists(), name
    summary = json.loads((d / "summary.json").read_text())
    for key in ("env_steps", "learner_steps", "wall_seconds", "final_eval_return", "best_eval_return",
                "env_steps_per_second", "energy_kwh", "emissions_kg"):
        assert key in summary, key
    assert summary["energy_kwh"] > 0 and summary["emissions_kg"] > 0
    assert summary["final_eval_return"] == summary["final_eval_return"]  # not NaN: a final evaluation ran
    eval_rows = _rows(d / "eval.csv")
    assert {"wall_seconds", "env_steps", "learner_steps", "return", "policy"} <= set(eval_rows[0])
    assert {r["policy"] for r in eval_rows} == {"fp32", "actor"}
    assert any(r["final"] == "1" for r in eval_rows)
    learner_rows = _rows(d / "learner.csv")
    assert {"learner_steps", "wall_seconds", "critic_loss", "policy_loss", "sgd_steps_per_s"} <= set(learner_rows[0])
    actor_rows = _rows(d / "actors" / "actor_0.csv")
    assert {"actor_id", "env_steps", "episode_return", "env_step_s", "inference_s", "adder_s", "pull_s",
            "deserialize_s", "load_s"} <= set(actor_rows[0])
    # Actors received advancing variable versions.
    versions = [int(r["params_version"]) for p in (d / "actors").glob("actor_*.csv") for r in _rows(p)]
    assert max(versions) > 0
    config = json.loads((d / "config.json").read_text())
    assert config["run"]["actor_bits"] == 8 and config["agent"]["policy_layers"] == [16, 16]
    assert any((d / "checkpoints").iterdir())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flags, named",
    [
        (["--actor_bits", "12"], "--actor_bits"),
        (["--comm_bits", "1"], "--comm_bits"),
        (["--num_actors", "0"], "--num_actors"),
        (["--task", "no_such_task"], "--task"),
        (["--policy_layers", "64,x"], "--policy_layers"),
        (["--granularity", "per_row"], "--granularity"),
        (["--actor_backend", "fp32", "--actor_bits", "8"], "--actor_backend"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, named, tmp_path):
    proc = subprocess.run([sys.executable, "experiments/run_d4pg.py", *flags, "--results_dir", str(tmp_path / "r")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing started


@pytest.mark.timeout(120)
def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, "experiments/run_d4pg.py", "--help"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=100).stdout
    for flag in ("--task", "--seed", "--num_actors", "--actor_bits", "--comm_bits", "--granularity", "--actor_backend",
                 "--policy_layers", "--critic_layers", "--update_period", "--max_env_steps", "--max_learner_steps",
                 "--max_seconds", "--results_dir", "--country", "--resume"):
        assert flag in out, flag


@pytest.mark.timeout(600)
def test_resume_continues_learner_steps_and_env_steps(tmp_path):
    results = tmp_path / "run"
    base = [sys.executable, "experiments/run_d4pg.py"]
    first = subprocess.run([*base, *TINY, "--num_actors", "1", "--max_learner_steps", "100",
                            "--results_dir", str(results)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=280)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    before = json.loads((results / "summary.json").read_text())
    second = subprocess.run([*base, "--resume", str(results), "--max_learner_steps", "200"], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=280)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    after = json.loads((results / "summary.json").read_text())
    assert before["learner_steps"] == 100 and after["learner_steps"] == 200
    assert after["env_steps"] > before["env_steps"]  # the counter carries on from the checkpoint
    steps = [int(r["learner_steps"]) for r in _rows(results / "learner.csv")]
    assert steps == [100, 200]  # one stream, continued rather than restarted
