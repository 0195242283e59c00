"""Tests for actorq_jax.environments: specs, seeding, episode ends, task names."""

import dm_env
import gymnasium
import numpy as np
import pytest
from dm_env import specs

from actorq_jax.environments import (
    DmControlEnvironment,
    EnvironmentSpec,
    GymnasiumEnvironment,
    available_tasks,
    environment_spec,
    make_environment,
)


def _rollout(env, actions):
    steps = [env.reset()]
    for action in actions:
        steps.append(env.step(action))
    return steps


def _assert_same_trajectory(a, b):
    assert len(a) == len(b)
    for ta, tb in zip(a, b):
        assert ta.step_type == tb.step_type
        assert ta.reward == tb.reward
        assert ta.discount == tb.discount
        np.testing.assert_array_equal(ta.observation, tb.observation)


def test_dm_control_specs_and_shapes():
    env = make_environment("cartpole_balance", seed=0)
    spec = environment_spec(env)
    # cartpole: position (3) + velocity (2), one bounded force in [-1, 1].
    assert spec == EnvironmentSpec(
        observation_dim=5,
        discrete=False,
        action_dim=1,
        num_actions=None,
        action_minimum=np.array([-1.0], np.float32),
        action_maximum=np.array([1.0], np.float32),
    )
    assert isinstance(env.action_spec(), specs.BoundedArray)
    assert env.action_spec().dtype == np.float32
    assert env.observation_spec().shape == (5,)

    first = env.reset()
    assert first.first() and first.reward is None
    assert first.observation.dtype == np.float32 and first.observation.shape == (5,)
    ts = env.step(np.array([0.5], np.float32))
    assert ts.mid()
    assert isinstance(ts.reward, np.float32) and isinstance(ts.discount, np.float32)
    assert ts.observation.dtype == np.float32 and ts.observation.shape == (5,)


def test_dm_control_observation_order_follows_suite():
    from dm_control import suite

    raw = suite.load("walker", "stand", task_kwargs={"random": 3})
    assert list(raw.observation_spec()) == ["orientations", "height", "velocity"]  # the suite's order, not sorted
    env = DmControlEnvironment(raw)
    ts = env.reset()
    assert ts.observation.shape == (14 + 1 + 9,)
    # The scalar "height" sits between orientations and velocity.
    np.testing.assert_allclose(ts.observation[14], raw.physics.torso_height(), rtol=1e-6)
    ts = env.step(np.zeros(6, np.float32))
    suite_observation = raw.task.get_observation(raw.physics)
    np.testing.assert_allclose(ts.observation, np.concatenate([np.ravel(suite_observation[k]) for k in
                                                               ("orientations", "height", "velocity")]), rtol=1e-6)


def test_dm_control_same_seed_same_trajectory():
    actions = [np.array([np.sin(i)], np.float32) for i in range(30)]
    a = _rollout(make_environment("cartpole_balance", seed=7), actions)
    b = _rollout(make_environment("cartpole_balance", seed=7), actions)
    c = _rollout(make_environment("cartpole_balance", seed=8), actions)
    _assert_same_trajectory(a, b)
    assert not np.array_equal(a[0].observation, c[0].observation)


def test_dm_control_time_limit_ends_with_discount_one():
    env = make_environment("cartpole_balance", seed=0)
    env.reset()
    steps = 0
    while True:
        ts = env.step(np.zeros(1, np.float32))
        steps += 1
        if ts.last():
            break
        assert ts.discount == 1.0
    assert steps == 1000  # the suite's own limit: 10 s at 0.01 s per control step
    assert ts.discount == np.float32(1.0)
    # Stepping after LAST starts the next episode.
    assert env.step(np.zeros(1, np.float32)).first()


def test_dm_control_max_episode_steps_and_action_repeat():
    env = make_environment("cartpole_balance", seed=0, max_episode_steps=5, action_repeat=2)
    env.reset()
    types = [env.step(np.zeros(1, np.float32)) for _ in range(6)]
    assert [t.step_type for t in types[:5]] == [dm_env.StepType.MID] * 4 + [dm_env.StepType.LAST]
    assert types[4].discount == 1.0
    assert types[5].first()
    # cartpole_balance pays at most 1 per physics step; two repeats can exceed 1.
    assert 1.0 < types[0].reward <= 2.0


def test_dm_control_wrapper_on_a_short_suite_time_limit():
    from dm_control import suite

    env = DmControlEnvironment(
        suite.load("cartpole", "balance", task_kwargs={"random": 1, "time_limit": 0.05})
    )
    env.reset()
    ts = [env.step(np.zeros(1, np.float32)) for _ in range(5)]
    assert [t.last() for t in ts] == [False] * 4 + [True]
    assert ts[-1].discount == 1.0


def test_gymnasium_specs_and_shapes():
    env = make_environment("CartPole-v1", seed=0)
    spec = environment_spec(env)
    assert spec.discrete and spec.num_actions == 2 and spec.action_dim is None
    assert spec.observation_dim == 4
    assert int(spec.action_minimum) == 0 and int(spec.action_maximum) == 1
    assert isinstance(env.action_spec(), specs.DiscreteArray)
    assert env.action_spec().num_values == 2
    ts = env.reset()
    assert ts.first() and ts.observation.dtype == np.float32 and ts.observation.shape == (4,)
    ts = env.step(np.int32(1))
    assert isinstance(ts.reward, np.float32) and ts.reward == 1.0
    assert ts.observation.shape == (4,)


@pytest.mark.parametrize("task,obs_dim,num_actions", [("MountainCar-v0", 2, 3), ("Acrobot-v1", 6, 3)])
def test_other_gymnasium_tasks(task, obs_dim, num_actions):
    spec = environment_spec(make_environment(task, seed=0))
    assert (spec.observation_dim, spec.num_actions) == (obs_dim, num_actions)


def test_gymnasium_same_seed_same_trajectory_across_episodes():
    # Alternating actions end CartPole episodes; 120 steps span several of them,
    # so later episodes (reset without a seed) must also repeat.
    actions = [i % 2 for i in range(120)] + [0] * 80
    a = _rollout(make_environment("CartPole-v1", seed=11), actions)
    b = _rollout(make_environment("CartPole-v1", seed=11), actions)
    _assert_same_trajectory(a, b)
    assert sum(t.first() for t in a) >= 3
    c = _rollout(make_environment("CartPole-v1", seed=12), actions)
    assert not np.array_equal(a[0].observation, c[0].observation)


def test_gymnasium_termination_has_discount_zero():
    env = make_environment("CartPole-v1", seed=0)
    env.reset()
    ts, steps = env.step(0), 1  # always pushing left topples the pole quickly
    while not ts.last() and steps < 500:
        ts, steps = env.step(0), steps + 1
    assert ts.last() and steps <= 100
    assert ts.discount == np.float32(0.0)
    assert env.step(0).first()


def test_gymnasium_truncation_has_discount_one():
    env = make_environment("CartPole-v1", seed=0, max_episode_steps=3)
    env.reset()
    ts = [env.step(i % 2) for i in range(3)]
    assert [t.step_type for t in ts] == [dm_env.StepType.MID, dm_env.StepType.MID, dm_env.StepType.LAST]
    assert ts[-1].discount == np.float32(1.0)


def test_gymnasium_wrapper_on_time_limit():
    gym_env = gymnasium.wrappers.TimeLimit(gymnasium.make("Acrobot-v1").unwrapped, max_episode_steps=4)
    env = GymnasiumEnvironment(gym_env, seed=0)
    env.reset()
    ts = [env.step(1) for _ in range(5)]
    assert [t.last() for t in ts[:4]] == [False, False, False, True]
    assert ts[3].discount == 1.0
    assert ts[4].first()


def test_gymnasium_action_repeat_sums_rewards_and_stops_at_the_end():
    env = make_environment("CartPole-v1", seed=0, action_repeat=3)
    env.reset()
    assert env.step(1).reward == 3.0  # CartPole pays 1 per underlying step
    ts, steps = env.step(0), 2
    while not ts.last():
        ts, steps = env.step(0), steps + 1
    assert ts.discount == 0.0 and 1.0 <= ts.reward <= 3.0  # the fall ended the repeat early
    assert steps <= 40  # pushing one way topples the pole within about 40 underlying steps, i.e. ~13 agent steps
    assert env.step(0).first()


def test_gymnasium_wrapper_rejects_continuous_actions():
    with pytest.raises(ValueError, match="Discrete"):
        GymnasiumEnvironment(gymnasium.make("Pendulum-v1"), seed=0)


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError) as info:
        make_environment("cartpole_balence", seed=0)
    message = str(info.value)
    assert "cartpole_balence" in message
    for name in ("cartpole_balance", "ball_in_cup_catch", "humanoid_walk", "CartPole-v1", "Acrobot-v1"):
        assert name in message


def test_available_tasks_resolve_names_with_underscores():
    tasks = available_tasks()
    for name in (
        "cartpole_balance", "walker_stand", "walker_walk", "finger_spin", "cheetah_run",
        "hopper_stand", "reacher_hard", "humanoid_stand", "humanoid_walk", "ball_in_cup_catch",
        "CartPole-v1", "MountainCar-v0", "Acrobot-v1",
    ):
        assert name in tasks
    assert len(tasks) == len(set(tasks))
    spec = environment_spec(make_environment("ball_in_cup_catch", seed=0))
    assert spec.action_dim == 2 and spec.observation_dim == 8


@pytest.mark.parametrize(
    "kwargs,bad",
    [
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 0, "action_repeat": 0}, "action_repeat"),
        ({"seed": 0, "max_episode_steps": 0}, "max_episode_steps"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        make_environment("CartPole-v1", **kwargs)


def test_environment_spec_is_frozen_and_read_only():
    spec = environment_spec(make_environment("cartpole_balance", seed=0))
    with pytest.raises(AttributeError):
        spec.observation_dim = 3
    with pytest.raises(ValueError):
        spec.action_minimum[0] = 0.0


@pytest.mark.parametrize("task", ["lqr_lqr_2_1", "lqr_lqr_6_2"])
def test_a_task_without_a_time_limit_ends_its_episodes_at_1000_steps(task):
    # LQR ends only near the origin, which a policy that does nothing never reaches: without a limit an
    # evaluation episode would never end.
    env = make_environment(task, seed=0)
    spec = environment_spec(env)
    timestep, steps = env.reset(), 0
    while not timestep.last() and steps < 2000:
        timestep, steps = env.step(np.zeros(spec.action_dim, np.float32)), steps + 1
    assert timestep.last() and steps == 1000 and timestep.discount == 1.0  # a truncation, not a terminal state
    assert _episode_length(make_environment(task, seed=0, max_episode_steps=20), spec.action_dim) == 20


def _episode_length(env, action_dim):
    timestep, steps = env.reset(), 0
    while not timestep.last():
        timestep, steps = env.step(np.zeros(action_dim, np.float32)), steps + 1
    return steps
