"""Replay regimes: the ratio limiter holds actors to the learner; min_size lets them run free (N samples an item)."""

import dataclasses

import numpy as np
import pytest
import reverb

from actorq_jax.agents.d4pg.config import D4PGConfig
from actorq_jax.agents.dqn.config import DQNConfig
from actorq_jax.agents.registry import get_agent
from actorq_jax.environments import EnvironmentSpec
from actorq_jax.replay import ItemLayout, ReplayServer, make_replay_table

OBS_DIM = 3


def _d4pg_builder(**overrides):
    config = dataclasses.replace(D4PGConfig(policy_layers=(8,), critic_layers=(8,), min_replay_size=5), **overrides)
    spec = EnvironmentSpec(observation_dim=OBS_DIM, discrete=False, action_dim=1, num_actions=None,
                           action_minimum=np.full(1, -1.0, np.float32), action_maximum=np.full(1, 1.0, np.float32))
    return get_agent("d4pg").make_builder(config, spec)


def _insert(client: reverb.Client, count: int, start: int = 0) -> None:
    """Inserts `count` transitions whose observation[0] is their index, with a bound on each write."""
    layout = ItemLayout.from_table(client.server_info(timeout=5)["replay"].signature)
    with client.trajectory_writer(num_keep_alive_refs=1) as writer:
        for i in range(start, start + count):
            writer.append(layout.pack({
                "observation": np.full(OBS_DIM, i, np.float32), "action": np.zeros(1, np.float32),
                "reward": np.float32(0.0), "discount": np.float32(1.0),
                "next_observation": np.full(OBS_DIM, i + 1, np.float32),
            }))
            writer.create_item("replay", 1.0, {k: col[-1] for k, col in writer.history.items()})
            # A ratio limiter that refuses inserts makes this raise instead of blocking the test.
            writer.flush(block_until_num_items=0, timeout_ms=2000)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_min_size_regime_lets_actors_insert_while_the_learner_is_stopped():
    builder = _d4pg_builder(rate_limiter="min_size", max_times_sampled=2)
    table = builder.replay_config()
    assert table.samples_per_insert is None and table.max_times_sampled == 2
    example = np.zeros(OBS_DIM, np.float32)
    with ReplayServer([make_replay_table(table, example, builder.example_action())]) as server:
        client = server.client()
        _insert(client, 200)  # far beyond what any samples-per-insert ratio would allow without sampling
        assert client.server_info(timeout=5)["replay"].current_size == 200


@pytest.mark.process
@pytest.mark.timeout(120)
def test_ratio_regime_holds_actors_back_while_the_learner_is_stopped():
    builder = _d4pg_builder(rate_limiter="ratio", samples_per_insert=4.0)
    example = np.zeros(OBS_DIM, np.float32)
    with ReplayServer([make_replay_table(builder.replay_config(), example, builder.example_action())]) as server:
        with pytest.raises(reverb.DeadlineExceededError):
            _insert(server.client(), 200)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_min_size_regime_removes_an_item_after_max_times_sampled_samples():
    builder = _d4pg_builder(rate_limiter="min_size", max_times_sampled=3, min_replay_size=1)
    example = np.zeros(OBS_DIM, np.float32)
    with ReplayServer([make_replay_table(builder.replay_config(), example, builder.example_action())]) as server:
        client = server.client()
        _insert(client, 1)
        # The packed row starts with the observation, whose first value is the item's index.
        seen = [int(next(client.sample("replay", num_samples=1, emit_timesteps=False)).data[0][0])
                for _ in range(3)]
        assert seen == [0, 0, 0]
        assert client.server_info(timeout=5)["replay"].current_size == 0  # gone after its third sample


@pytest.mark.parametrize(
    "config_class, overrides, field",
    [
        (D4PGConfig, {"rate_limiter": "min_size"}, "max_times_sampled"),  # free actors need a cap
        (DQNConfig, {"rate_limiter": "min_size", "max_times_sampled": 0}, "max_times_sampled"),
        (DQNConfig, {"max_times_sampled": 4}, "max_times_sampled"),  # the cap belongs to min_size
        (D4PGConfig, {"rate_limiter": "fifo"}, "rate_limiter"),
        (DQNConfig, {"rate_limiter": "min_size", "max_times_sampled": -1}, "max_times_sampled"),
    ],
)
def test_bad_regime_combinations_name_the_field(config_class, overrides, field):
    with pytest.raises(ValueError, match=f"{config_class.__name__}.{field}"):
        config_class(**overrides)


def test_both_agents_build_the_paper_regime():
    assert DQNConfig(rate_limiter="min_size", max_times_sampled=8).max_times_sampled == 8
    table = _d4pg_builder(rate_limiter="min_size", max_times_sampled=8).replay_config()
    assert (table.samples_per_insert, table.max_times_sampled) == (None, 8)
    default = _d4pg_builder().replay_config()
    assert (default.samples_per_insert, default.max_times_sampled) == (32.0, 0)


def _timestep(step_type: int, observation_value: float):
    import dm_env

    return dm_env.TimeStep(dm_env.StepType(step_type), np.float32(0.0) if step_type else None,
                           np.float32(1.0) if step_type else None, np.full(OBS_DIM, observation_value, np.float32))


@pytest.mark.process
@pytest.mark.timeout(120)
def test_adder_reports_the_time_the_rate_limiter_held_it():
    import threading
    import time

    from actorq_jax.replay import NStepAdder, ReplayDataset

    # Ratio 1 with a small buffer: once a few items are in, inserts wait for samples.
    builder = _d4pg_builder(samples_per_insert=1.0, min_replay_size=2)
    table = dataclasses.replace(builder.replay_config(), error_tolerance=2.0)
    example = np.zeros(OBS_DIM, np.float32)
    held_s = 1.0
    with ReplayServer([make_replay_table(table, example, builder.example_action())]) as server:
        client = server.client()
        adder = NStepAdder(client, "replay", n_step=1, discount=0.9, max_in_flight_items=1, timeout_s=30)

        done = threading.Event()

        def learner_after_a_while() -> None:
            time.sleep(held_s)  # the learner is "stopped" this long, then samples as the limiter allows
            while not done.is_set():
                # A dataset ends once the limiter has refused it for 200 ms, so this thread never blocks for good.
                for _ in ReplayDataset(server.address, "replay", batch_size=1, prefetch=0, rate_limiter_timeout_ms=200):
                    pass

        learner = threading.Thread(target=learner_after_a_while, daemon=True)
        learner.start()
        adder.add_first(_timestep(0, 0.0))
        total = 0.0
        for i in range(1, 21):
            start = time.perf_counter()
            adder.add(np.zeros(1, np.float32), _timestep(1 if i < 20 else 2, float(i)))
            total += time.perf_counter() - start
        adder.close()
        done.set()
        learner.join(30)
    # The write itself (the rest of `total`) is never negative, and the hold shows up as wait.
    assert 0.8 * held_s <= adder.wait_s <= total


@pytest.mark.process
@pytest.mark.timeout(120)
def test_an_episode_whose_items_the_limiter_held_past_the_timeout_leaves_the_next_episode_writable():
    from actorq_jax.replay import NStepAdder, WriteTimeout

    # Ratio 1 with a small buffer and no learner: after a few items, the server holds every insert.
    builder = _d4pg_builder(samples_per_insert=1.0, min_replay_size=2)
    table = dataclasses.replace(builder.replay_config(), error_tolerance=2.0)
    action = np.zeros_like(builder.example_action())
    with ReplayServer([make_replay_table(table, np.zeros(OBS_DIM, np.float32), builder.example_action())]) as server:
        # One item per step (chunk_length=1): the new episode's first item is created, its references resolved, at once.
        adder = NStepAdder(server.client(), "replay", n_step=2, discount=0.9, max_in_flight_items=1000, timeout_s=0.5,
                           chunk_length=1)
        with pytest.raises(WriteTimeout):
            adder.add_first(_timestep(0, 0.0))
            for t in range(1, 40):  # the limiter holds the items; the episode's end waits past the timeout
                adder.add(action, _timestep(2 if t == 39 else 1, float(t)))
        assert adder.episodes == 1
        # The next episode (the actor goes on once the learner is back) references its own steps, not the old
        # episode's released ones (which failed with "TrajectoryColumns cannot contain any None data references").
        written = adder.items_written
        adder.add_first(_timestep(0, 100.0))
        for t in range(1, 4):
            adder.add(action, _timestep(1, 100.0 + t))
        assert adder.items_written == written + 2  # o_0 -> o_2 and o_1 -> o_3 (n = 2)
        adder.close(flush=False)
