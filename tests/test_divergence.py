"""A learner whose losses or parameters stop being finite stops at once, says where, and can be resumed;
a results directory that cannot be written is refused before anything starts."""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from launch_support import ENV, ROOT, TINY, rows

from actorq_jax.finite import first_non_finite
from actorq_jax.launch.checkpoint import finished_steps
from actorq_jax.launch.flags import parse_run


def test_first_non_finite_names_the_leaf_and_the_kind():
    assert first_non_finite({"critic_loss": jnp.float32(0.5), "policy_loss": jnp.float32(np.nan)}) == "policy_loss is nan"
    tree = {"critic": {"w": jnp.ones((2, 2)), "b": jnp.array([1.0, -np.inf])}}
    assert first_non_finite(tree, "state ") == "state critic/b is inf"
    # Integer leaves (step counters, replay keys) cannot be non-finite and are skipped.
    assert first_non_finite({"steps": np.arange(3), "loss": jnp.float32(1.0)}) is None
    # The same structure with a float where the integer was above: that leaf is checked, not skipped.
    assert first_non_finite({"steps": np.array([np.inf]), "loss": jnp.float32(1.0)}) == "steps is inf"
    # Python scalars, half-precision leaves and empty trees.
    assert first_non_finite({"lr": 1e-3, "n": 3}) is None and first_non_finite({"lr": float("nan")}) == "lr is nan"
    assert first_non_finite([jnp.ones(2, jnp.bfloat16), jnp.array([1.0, -np.inf], jnp.bfloat16)]) == "1 is inf"
    assert first_non_finite({}) is None


def test_a_resumed_run_may_change_its_step_sizes_and_nothing_else(tmp_path, capsys):
    results = tmp_path / "run"
    run, agent = parse_run("d4pg", [*TINY, "--results_dir", str(results)])
    from actorq_jax.launch.config import save_config

    results.mkdir()
    save_config(results / "config.json", run, agent)
    _, resumed = parse_run("d4pg", ["--resume", str(results), "--critic_learning_rate", "1e-5"])
    assert resumed.critic_learning_rate == 1e-5 and resumed.policy_learning_rate == agent.policy_learning_rate
    # Flags that were not given keep the run's values, even where they differ from the defaults; one given with
    # the run's own value is no change.
    kept_run, same = parse_run("d4pg", ["--resume", str(results), "--batch_size", "16", "--max_seconds", "5"])
    assert same.batch_size == agent.batch_size == 16 and same.policy_layers == agent.policy_layers
    assert kept_run.max_seconds == 5 and kept_run.num_actors == run.num_actors
    # The wire's width left unset is the actors' width: naming it is no change either.
    assert run.comm_bits is None and run.actor_bits == 8
    wired, _ = parse_run("d4pg", ["--resume", str(results), "--comm_bits", "8"])
    assert wired.wire_bits == 8
    # Any other change would be dropped without a word: it is refused by name, with the run's value.
    for flags, named in ((["--batch_size", "64"], "--batch_size: the resumed run has 16"),
                         (["--num_actors", str(run.num_actors + 1)], f"--num_actors: the resumed run has {run.num_actors}"),
                         (["--policy_layers", "8,8"], "--policy_layers: the resumed run has"),
                         (["--comm_bits", "32"], "--comm_bits: the resumed run has 8"),
                         (["--results_dir", str(tmp_path / "elsewhere")], "is not the resumed run's directory")):
        with pytest.raises(SystemExit) as exit_info:
            parse_run("d4pg", ["--resume", str(results), *flags])
        assert exit_info.value.code == 2
        message = capsys.readouterr().err
        assert named in message and "Traceback" not in message, message


def test_a_run_resumed_where_its_cores_are_missing_is_refused_by_name_and_may_be_placed_anew(tmp_path, capsys):
    import dataclasses
    import os

    from actorq_jax.launch.config import save_config
    from actorq_jax.launch.runtime import apply_cpu_affinity

    # Pinned on a bigger machine: core 4095 is not one this process may use.
    results = tmp_path / "run"
    run, agent = parse_run("d4pg", [*TINY, "--results_dir", str(results)])
    results.mkdir()
    save_config(results / "config.json", dataclasses.replace(run, learner_cpus="4095", actor_cpus="0"), agent)
    with pytest.raises(SystemExit) as exit_info:
        parse_run("d4pg", ["--resume", str(results)])
    message = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--learner_cpus: core(s) [4095] are not available" in message, message
    assert "a resume may give --learner_cpus anew" in message and "Traceback" not in message
    # Where the roles run is not part of the run: a resume may move them, and nothing else changes.
    core = str(min(os.sched_getaffinity(0)))
    moved, same = parse_run("d4pg", ["--resume", str(results), "--learner_cpus", core, "--layout", "shared"])
    assert (moved.learner_cpus, moved.actor_cpus, moved.layout) == (core, "0", "shared") and same == agent
    assert dataclasses.replace(moved, learner_cpus=run.learner_cpus, actor_cpus=run.actor_cpus, resume=False,
                               results_dir=run.results_dir) == run
    # A worker given such a config (a cgroup that shrank after the check) says so by flag, without a traceback.
    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match=r"cannot pin the learner to cores \[4095\] \(--learner_cpus or --layout\)"):
        apply_cpu_affinity("learner", dataclasses.replace(run, learner_cpus="4095"))
    assert os.sched_getaffinity(0) == before


def test_a_resumed_run_goes_on_in_the_directory_it_is_resumed_from(tmp_path, monkeypatch):
    from actorq_jax.launch.config import save_config

    # Started from a working directory with a relative path, then moved: config.json's path leads nowhere now.
    monkeypatch.chdir(tmp_path)
    run, agent = parse_run("d4pg", [*TINY, "--results_dir", "results/first"])
    (tmp_path / "results" / "first").mkdir(parents=True)
    save_config(tmp_path / "results" / "first" / "config.json", run, agent)
    (tmp_path / "results" / "first").rename(tmp_path / "moved")
    monkeypatch.chdir(ROOT)
    resumed, _ = parse_run("d4pg", ["--resume", str(tmp_path / "moved")])
    assert resumed.results_dir == str(tmp_path / "moved") and resumed.resume


def test_a_run_is_resumed_only_by_its_own_agent(tmp_path, capsys):
    from actorq_jax.launch.config import save_config

    run, agent = parse_run("d4pg", [*TINY, "--results_dir", str(tmp_path / "run")])
    (tmp_path / "run").mkdir()
    save_config(tmp_path / "run" / "config.json", run, agent)
    with pytest.raises(SystemExit) as exit_info:
        parse_run("dqn", ["--resume", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert f"holds a d4pg run, not dqn; resume it with experiments/run.py --agent d4pg --resume {tmp_path / 'run'}" in \
        capsys.readouterr().err


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_publisher_refuses_non_finite_parameters():
    from actorq_jax.quantization import QuantConfig
    from actorq_jax.replay import ReplayServer, VariablePublisher, make_variables_table

    with ReplayServer([make_variables_table("variables")]) as server:
        publisher = VariablePublisher(server.client(), "variables", QuantConfig(bits=8))
        params = {"layer": {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}}
        publisher.publish(params, 1)
        bad = {"layer": {"w": jnp.ones((4, 4)).at[0, 0].set(jnp.nan), "b": jnp.zeros(4)}}
        with pytest.raises(ValueError, match="refusing to publish version 2: parameter layer/w is nan"):
            publisher.publish(bad, 2)
        assert publisher.published == 1
        assert server.client().server_info(timeout=5)["variables"].current_size == 1


def _run(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "experiments/run_d4pg.py", *flags], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.timeout(600)
def test_a_diverging_learner_stops_the_run_keeping_the_last_finite_checkpoint_and_resumes(tmp_path):
    results = tmp_path / "run"
    first = _run(*TINY, "--max_learner_steps", "100", "--results_dir", str(results))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert finished_steps(results / "checkpoints") == [100]

    # A step size that blows the critic up within a few steps.
    diverged = _run("--resume", str(results), "--critic_learning_rate", "1e30", "--max_learner_steps", "400")
    assert diverged.returncode == 1, diverged.stdout[-2000:] + diverged.stderr[-2000:]
    lines = [line for line in diverged.stderr.splitlines() if "learner diverged at step" in line]
    assert len(lines) == 1, diverged.stderr[-3000:]
    assert "is nan" in lines[0] or "is inf" in lines[0]
    assert lines[0].endswith("last finite checkpoint at step 100"), lines[0]
    assert "Traceback" not in diverged.stderr
    # Nothing after the divergence was checkpointed or logged as a good row.
    assert finished_steps(results / "checkpoints") == [100]
    assert all(np.isfinite(r["critic_loss"]) for r in rows(results / "learner.csv"))
    summary = json.loads((results / "summary.json").read_text())
    assert summary["exit_code"] == 1 and summary["learner_restarts"] == 0

    # The user lowers the step size and resumes from the last finite checkpoint.
    resumed = _run("--resume", str(results), "--critic_learning_rate", "1e-4", "--max_learner_steps", "200")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert json.loads((results / "status" / "learner.json").read_text())["restored"]["learner_steps"] == 100
    assert json.loads((results / "summary.json").read_text())["learner_steps"] == 200
    assert json.loads((results / "config.json").read_text())["agent"]["critic_learning_rate"] == 1e-4


def test_a_results_dir_that_cannot_be_created_is_refused_naming_the_flag(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit) as exit_info:
        parse_run("d4pg", [*TINY, "--results_dir", str(blocker / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--results_dir: {blocker / 'run'} cannot be created: {blocker} is a file, not a directory" in err
    assert blocker.read_text() == "not a directory"
