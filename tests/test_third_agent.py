"""A third agent whose replay items are not n-step Transitions runs through the contract and the launcher.

The agent (tests/third_agent.py) writes one-step items carrying the env step index, with its own
adder, item signature, dataset and learner; nothing in launch/ knows it.
"""

import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from launch_support import ENV, ROOT, rows

from actorq_jax.agents.registry import AGENT_MODULES_ENV, get_agent, register_agent, unregister_agent

TESTS = ROOT / "tests"


@pytest.fixture
def third():
    """The third agent registered in this process (and nowhere else once the test is over)."""
    module = importlib.import_module("third_agent")  # tests/ is on sys.path: registers on first import
    register_agent(module.ENTRY)
    yield module
    unregister_agent(module.NAME)


def _builder(module, **fields):
    from actorq_jax.environments import environment_spec, make_environment

    spec = environment_spec(make_environment("CartPole-v1", seed=0))
    return get_agent(module.NAME).make_builder(module.ThirdConfig(**fields), spec)


def test_the_third_agent_declares_its_own_data_path(third):
    from actorq_jax.replay import transition_signature

    builder = _builder(third)
    signature = builder.item_signature()
    assert set(signature) == set(third.StepItem._fields) and signature["step_index"].dtype.name == "int32"
    assert set(signature) - set(transition_signature(np.zeros(4, np.float32), builder.example_action())) == {"step_index"}
    assert builder.priority_feedback() is None  # uniform replay: nothing written back, nothing published
    assert builder.loggable_metrics({"loss": np.float32(2.0), "step_index_max": np.arange(3.0)}) == {
        "loss": 2.0, "step_index_max": 1.0}


@pytest.mark.process
@pytest.mark.timeout(180)
def test_items_sampled_by_its_dataset_carry_the_step_index_the_adder_wrote(third):
    """Every sampled item is the step its index names: observation, action and next observation line up."""
    import reverb

    from actorq_jax.environments import make_environment
    from actorq_jax.replay import ReplayServer

    builder = _builder(third, batch_size=4, rate_limiter="min_size", max_times_sampled=1, min_replay_size=1)
    env = make_environment("CartPole-v1", seed=3)
    with ReplayServer(builder.replay_tables()) as server:
        adder = builder.make_adder(reverb.Client(f"127.0.0.1:{server.port}"), timeout_s=10.0, connect_timeout_s=10.0)
        timestep = env.reset()
        adder.add_first(timestep)
        observations, actions, rng = [np.asarray(timestep.observation, np.float32)], [], np.random.default_rng(0)
        while not timestep.last():
            actions.append(int(rng.integers(2)))
            timestep = env.step(np.int32(actions[-1]))
            adder.add(actions[-1], timestep)
            observations.append(np.asarray(timestep.observation, np.float32))
        adder.close()
        length = len(actions)
        dataset = builder.make_dataset(f"127.0.0.1:{server.port}", rate_limiter_timeout_ms=2000)
        seen = []
        for batch in dataset:  # each item once (max_times_sampled 1), until the limiter has none left
            assert isinstance(batch.data, third.StepItem)
            for i, t in enumerate(batch.data.step_index):
                np.testing.assert_array_equal(batch.data.observation[i], observations[t])
                np.testing.assert_array_equal(batch.data.next_observation[i], observations[t + 1])
                assert batch.data.action[i] == actions[t] and batch.data.reward[i] == 1.0
                assert batch.data.discount[i] == np.float32(0.0 if t == length - 1 else builder.config.discount)
                seen.append(int(t))
    assert len(seen) == len(set(seen)) == length - length % 4  # whole batches of distinct steps
    assert set(seen) <= set(range(length)) and length > 4


@pytest.mark.process
@pytest.mark.timeout(420)
def test_the_third_agent_runs_end_to_end_through_the_launcher(third, tmp_path):
    results = tmp_path / "run"
    # The workers import the agent as the launcher does: from tests/ on their path, named by the environment.
    env = {**ENV, AGENT_MODULES_ENV: third.MODULE,
           "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), ENV.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "experiments/run.py", "--agent", third.NAME, *third.ENTRY.tiny,
                           "--num_actors", "1", "--max_learner_steps", "200", "--max_seconds", "300",
                           "--results_dir", str(results)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["learner_steps"] >= 200 and summary["env_steps"] > 0
    assert json.loads((results / "config.json").read_text())["run"]["agent"] == third.NAME

    learner_rows = rows(results / "learner.csv")
    assert learner_rows and {"loss", "step_index_running_mean", "step_index_min", "step_index_max"} <= set(learner_rows[0])
    for row in learner_rows:
        assert 0 <= row["step_index_min"] <= row["step_index_max"] < 500  # CartPole-v1 ends at step 500
        assert row["step_index_min"] == int(row["step_index_min"]) and row["step_index_max"] == int(row["step_index_max"])
    assert max(row["step_index_max"] for row in learner_rows) >= 1  # not one constant
    # The learner's mean over every item it sampled. Uniform sampling from a table that only grows draws each
    # batch from the items written so far, a prefix of the actor's stream (its episodes in order, then the
    # start of the episode under way): the running mean is a mixture of prefix means, so it lies between the
    # smallest and the largest of them over the prefixes the learner sampled from (at least --min_replay_size
    # items, at most what was written by its last row, with a tenth more for items written while that row was
    # made). Early items are drawn more often than late ones, so the mean over the whole stream is not it.
    lengths = [int(r["episode_length"]) for r in rows(results / "actors" / "actor_0.csv")]
    last = int(learner_rows[-1]["env_steps"])
    low, high = third.prefix_mean_range(lengths, third.ThirdConfig().min_replay_size, last + last // 10 + 1)
    sampled = learner_rows[-1]["step_index_running_mean"]
    # 3 for the sampling noise: the mean of 3,200 draws of indices whose spread is under 150.
    assert low - 3.0 <= sampled <= high + 3.0, (sampled, low, high, lengths, last)
