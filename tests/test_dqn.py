"""DQN: the double-Q loss by hand, priorities in Reverb, epsilon-greedy policies, learning, and one short run."""

import dataclasses
import json
import subprocess
import sys

import dm_env
import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest
from launch_support import ENV, ROOT, TINY_DQN

from actorq_jax.agents.builder import single_env
from actorq_jax.agents.dqn import acting, learning
from actorq_jax.agents.dqn.builder import DQNBuilder
from actorq_jax.agents.dqn.config import DQNConfig
from actorq_jax.environments import EnvironmentSpec
from actorq_jax.networks import QNetwork
from actorq_jax.replay import (
    NStepAdder,
    ReplayBatch,
    ReplayDataset,
    ReplayServer,
    Transition,
    make_replay_table,
    update_priorities,
)

OBS_DIM, NUM_ACTIONS = 4, 3


def _spec(num_actions: int = NUM_ACTIONS, obs_dim: int = OBS_DIM) -> EnvironmentSpec:
    return EnvironmentSpec(
        observation_dim=obs_dim, discrete=True, action_dim=None, num_actions=num_actions,
        action_minimum=np.asarray(0, np.int32), action_maximum=np.asarray(num_actions - 1, np.int32),
    )


def _tiny_config(**overrides) -> DQNConfig:
    base = DQNConfig(q_layers=(16, 16), batch_size=8, target_update_period=3, min_replay_size=1)
    return dataclasses.replace(base, **overrides)


def _batch(size: int = 8, seed: int = 0) -> ReplayBatch:
    rng = np.random.default_rng(seed)
    data = Transition(
        observation=rng.normal(size=(size, OBS_DIM)).astype(np.float32),
        action=rng.integers(0, NUM_ACTIONS, size=(size,)).astype(np.int32),
        reward=rng.normal(size=(size,)).astype(np.float32),
        discount=np.full((size,), 0.9, np.float32),
        next_observation=rng.normal(size=(size, OBS_DIM)).astype(np.float32),
    )
    return ReplayBatch(
        data=data,
        keys=np.arange(size, dtype=np.uint64),
        probabilities=np.full((size,), 1.0 / size),
        table_size=np.full((size,), size, np.int64),
    )


# -- the loss ---------------------------------------------------------------------------------------------


def _linear_params(matrix) -> dict:
    """Parameters of a hidden-layer-free QNetwork with Q(s) = s @ matrix."""
    matrix = jnp.asarray(matrix, jnp.float32)
    return {"params": {"head": {"kernel": matrix, "bias": jnp.zeros((matrix.shape[1],), jnp.float32)}}}


def _hand_case():
    # Online Q(s) = s; target Q(s) = s with its two actions swapped, so the online argmax and the
    # target's own argmax disagree and only double Q-learning gives the targets below.
    online = _linear_params(np.eye(2))
    target = _linear_params([[0.0, 1.0], [1.0, 0.0]])
    data = Transition(
        observation=np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 3.0]], np.float32),
        action=np.array([0, 1, 0], np.int32),
        reward=np.array([1.0, -1.0, 0.5], np.float32),
        discount=np.array([0.5, 0.0, 0.25], np.float32),
        next_observation=np.array([[0.3, 0.7], [5.0, 1.0], [2.0, 0.5]], np.float32),
    )
    # 1: Q=1; online picks a'=1 at [0.3, 0.7]; target values it 0.3 -> y = 1 + 0.5 * 0.3 = 1.15, td = 0.15
    #    (max over the target net would give y = 1 + 0.5 * 0.7 = 1.35 instead).
    # 2: Q=2; terminal (discount 0) -> y = -1, td = -3.
    # 3: Q=1; online picks a'=0 at [2, 0.5]; target values it 0.5 -> y = 0.5 + 0.25 * 0.5 = 0.625, td = -0.375.
    expected_td = np.array([0.15, -3.0, -0.375])
    return online, target, data, expected_td


def test_double_q_td_errors_and_loss_match_hand_computation():
    online, target, data, expected_td = _hand_case()
    network = QNetwork(num_actions=2, layer_sizes=())
    td = learning.td_errors(online, target, network, data)
    np.testing.assert_allclose(td, expected_td, rtol=1e-6, atol=1e-6)
    # Huber(delta=1): 0.5 * 0.15^2, 3 - 0.5, 0.5 * 0.375^2; with IS weights (N*P)^-beta / max.
    huber = np.array([0.5 * 0.15**2, 2.5, 0.5 * 0.375**2])
    probabilities = np.array([0.5, 0.25, 0.25])
    weights = (4 * probabilities) ** -0.5
    weights = weights / weights.max()
    np.testing.assert_allclose(weights, [2**-0.5, 1.0, 1.0])
    loss, _ = learning.loss_fn(online, target, network, data, jnp.asarray(weights, jnp.float32), 1.0)
    np.testing.assert_allclose(loss, np.mean(weights * huber), rtol=1e-6)
    l2_loss, _ = learning.loss_fn(online, target, network, data, jnp.ones(3), 0.0)
    np.testing.assert_allclose(l2_loss, np.mean(0.5 * expected_td**2), rtol=1e-6)

    # The jitted step computes the same loss from the sampling info and reports |td| as priorities.
    config = _tiny_config(importance_sampling_exponent=0.5, target_update_period=100)
    state = learning.TrainingState(online, target, learning.make_optimizers(config).q.init(online), jnp.zeros((), jnp.int32))
    batch = ReplayBatch(data, np.arange(3, dtype=np.uint64), probabilities, np.full(3, 4, np.int64))
    _, metrics = learning.make_sgd_step(config, learning.DQNNetworks(q=network))(state, batch)
    np.testing.assert_allclose(metrics["loss"], np.mean(weights * huber), rtol=1e-6)
    np.testing.assert_allclose(metrics["priorities"], np.abs(expected_td), rtol=1e-6, atol=1e-6)


def test_sgd_step_lowers_the_loss_on_a_fixed_batch():
    config = _tiny_config(target_update_period=1000)
    builder = DQNBuilder(config, _spec())
    state = builder.init_state(jax.random.PRNGKey(0))
    batch = _batch()
    state, first = builder.sgd_step(state, batch)
    for _ in range(100):
        state, metrics = builder.sgd_step(state, batch)
    assert int(state.steps) == 101
    assert float(metrics["loss"]) < 0.2 * float(first["loss"])
    assert metrics["priorities"].shape == (8,)


def test_target_parameters_change_exactly_every_target_period():
    builder = DQNBuilder(_tiny_config(target_update_period=3), _spec())
    state = builder.init_state(jax.random.PRNGKey(1))
    batch = _batch(seed=1)
    changed_at = []
    for step in range(1, 10):
        previous = state.target_params
        state, _ = builder.sgd_step(state, batch)
        same = jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, previous, state.target_params))
        if not same:
            changed_at.append(step)
            # A hard copy: the target equals the online network right after the update.
            assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, state.params, state.target_params))
    assert changed_at == [3, 6, 9]


# -- the policies -----------------------------------------------------------------------------------------


def _observations(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, OBS_DIM)).astype(np.float32)


def _behaviour(builder: DQNBuilder, epsilon: float):
    """The one-environment epsilon-greedy policy at this epsilon."""
    return single_env(acting.make_vector_behaviour_policy(builder.networks, [epsilon]))


def test_epsilon_zero_is_greedy():
    builder = DQNBuilder(_tiny_config(), _spec())
    params = builder.init_state(jax.random.PRNGKey(2)).params
    greedy = builder.greedy_policy()
    behaviour = _behaviour(builder, 0.0)
    keys = jax.random.split(jax.random.PRNGKey(3), 200)
    observations = _observations(200)
    expected = np.array([int(greedy(params, o)) for o in observations])
    actions = jax.vmap(behaviour, in_axes=(None, 0, 0))(params, keys, observations)
    np.testing.assert_array_equal(actions, expected)
    # The greedy action is the argmax of the network's Q-values, and the network is not constant.
    q_values = builder.networks.q.apply(params, observations)
    np.testing.assert_array_equal(expected, np.argmax(q_values, axis=-1))
    assert len(set(expected.tolist())) > 1


def test_epsilon_one_is_uniform_and_epsilon_half_mixes():
    builder = DQNBuilder(_tiny_config(), _spec())
    params = builder.init_state(jax.random.PRNGKey(4)).params
    observation = _observations(1)[0]
    greedy_action = int(builder.greedy_policy()(params, observation))
    keys = jax.random.split(jax.random.PRNGKey(5), 6000)
    uniform = _behaviour(builder, 1.0)
    actions = np.asarray(jax.vmap(uniform, in_axes=(None, 0, None))(params, keys, observation))
    assert actions.dtype == np.int32
    counts = np.bincount(actions, minlength=NUM_ACTIONS)
    expected = len(actions) / NUM_ACTIONS
    chi_square = float(np.sum((counts - expected) ** 2 / expected))
    assert chi_square < 13.82, counts  # 99.9% quantile of chi-square with 2 degrees of freedom
    # epsilon 0.5: the greedy action has probability 0.5 + 0.5 / 3 = 2/3 (binomial sd ~ 0.006 here).
    half = _behaviour(builder, 0.5)
    actions = np.asarray(jax.vmap(half, in_axes=(None, 0, None))(params, keys, observation))
    assert abs(np.mean(actions == greedy_action) - 2 / 3) < 0.03
    with pytest.raises(ValueError, match="epsilon"):
        _behaviour(builder, 1.5)


def test_same_seed_same_actions():
    def rollout(seed: int) -> list:
        builder = DQNBuilder(_tiny_config(), _spec())
        params = builder.init_state(jax.random.PRNGKey(seed)).params
        policy = builder.behaviour_policy(0, 1)  # epsilon 0.4: both branches are exercised
        key = jax.random.PRNGKey(seed)
        return [int(policy(params, jax.random.fold_in(key, t), o)) for t, o in enumerate(_observations(100))]

    first, again, other = rollout(7), rollout(7), rollout(8)
    assert first == again
    assert first != other


# -- config and builder -----------------------------------------------------------------------------------


def test_ape_x_epsilon_spread_and_config_validation():
    config = DQNConfig()
    assert config.actor_epsilon(0, 1) == pytest.approx(0.4)
    assert config.actor_epsilon(0, 4) == pytest.approx(0.4)
    assert config.actor_epsilon(3, 4) == pytest.approx(0.4**8)
    assert config.actor_epsilon(1, 3) == pytest.approx(0.4**4.5)
    assert config.actor_epsilon(100, 4) == pytest.approx(0.4**8)  # a remote actor beyond the local ids
    fixed = DQNConfig(epsilon=0.05, epsilon_alpha=0.0)
    assert [fixed.actor_epsilon(i, 5) for i in range(5)] == pytest.approx([0.05] * 5)
    for bad in ({"epsilon": 1.5}, {"n_step": 0}, {"discount": 0.0}, {"learning_rate": 0.0},
                {"q_layers": ()}, {"importance_sampling_exponent": -1.0}, {"min_replay_size": 10, "max_replay_size": 5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DQNConfig(**bad)
    with pytest.raises(ValueError, match="actor_id"):
        config.actor_epsilon(-1, 2)


def test_builder_contract_and_continuous_tasks_rejected():
    builder = DQNBuilder(_tiny_config(priority_exponent=0.7), _spec())
    assert builder.prioritized
    table = builder.replay_config()
    assert table.prioritized and table.priority_exponent == 0.7
    action = builder.example_action()
    assert action.shape == () and action.dtype == np.int32
    state = builder.init_state(jax.random.PRNGKey(0))
    shapes = lambda tree: jax.tree_util.tree_map(np.shape, tree)  # noqa: E731
    assert shapes(builder.params_template()) == shapes(builder.actor_params(state))
    continuous = EnvironmentSpec(
        observation_dim=3, discrete=False, action_dim=1, num_actions=None,
        action_minimum=np.full(1, -1.0, np.float32), action_maximum=np.full(1, 1.0, np.float32),
    )
    with pytest.raises(ValueError, match="discrete"):
        DQNBuilder(_tiny_config(), continuous)


def test_paper_sized_q_network_trains():
    builder = DQNBuilder(_tiny_config(q_layers=(2048, 2048, 2048)), _spec())
    state = builder.init_state(jax.random.PRNGKey(0))
    kernels = [leaf.shape for leaf in jax.tree_util.tree_leaves(state.params) if leaf.ndim == 2]
    assert sorted(kernels) == sorted([(OBS_DIM, 2048), (2048, 2048), (2048, 2048), (2048, NUM_ACTIONS)])
    state, metrics = builder.sgd_step(state, _batch())
    assert np.isfinite(float(metrics["loss"])) and int(state.steps) == 1


# -- priorities in Reverb ---------------------------------------------------------------------------------


def _fill(server: ReplayServer, table: str, items: int) -> None:
    """Writes `items` one-step transitions of one episode (observation i has every entry equal to i)."""
    with NStepAdder(server.client(), table, n_step=1, discount=0.99) as adder:
        adder.add_first(dm_env.restart(np.zeros(OBS_DIM, np.float32)))
        for i in range(1, items + 1):
            obs = np.full(OBS_DIM, float(i), np.float32)
            step = dm_env.termination(1.0, obs) if i == items else dm_env.transition(1.0, obs)
            adder.add(np.int32(i % NUM_ACTIONS), step)


def _sample(server: ReplayServer, table: str, count: int) -> ReplayBatch:
    # No prefetch and one request at a time: every batch is drawn under the current priorities.
    dataset = ReplayDataset(server.address, table, count, prefetch=0, with_info=True, num_workers=1,
                            max_in_flight_samples=count, rate_limiter_timeout_ms=10_000)
    return next(dataset)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_priorities_written_back_change_what_reverb_samples():
    builder = DQNBuilder(_tiny_config(batch_size=64, priority_exponent=1.0), _spec())
    # No sample/insert ratio here: the test samples far more than it inserts.
    table_config = dataclasses.replace(builder.replay_config(), samples_per_insert=None, min_size=1)
    items = 8
    with ReplayServer([make_replay_table(table_config, np.zeros(OBS_DIM, np.float32), builder.example_action())]) as server:
        _fill(server, table_config.name, items)
        # The learner's path: a batch, one SGD step, |td| written back as priorities.
        batch = _sample(server, table_config.name, 64)
        np.testing.assert_allclose(batch.probabilities, 1.0 / items)  # actors insert at priority 1
        assert np.all(batch.table_size == items)
        state = builder.init_state(jax.random.PRNGKey(0))
        _, metrics = builder.sgd_step(state, batch)
        priorities = np.asarray(metrics["priorities"], np.float64)
        update_priorities(server.client(), table_config.name, batch.keys, priorities)
        written = {int(k): p for k, p in zip(batch.keys, priorities)}  # duplicates keep the last
        assert len(written) == items  # 64 draws of 8 items touch every item
        after = _sample(server, table_config.name, 64)
        total = sum(written.values())
        expected = np.array([written[int(k)] / total for k in after.keys])  # priority_exponent 1
        np.testing.assert_allclose(after.probabilities, expected, rtol=1e-5)

        # One item made very likely dominates what Reverb hands out.
        favourite = int(after.keys[0])
        update_priorities(server.client(), table_config.name, list(written), [1e-3] * items)
        update_priorities(server.client(), table_config.name, [favourite], [1e3])
        dominated = _sample(server, table_config.name, 256)
        share = np.mean(dominated.keys.astype(np.uint64) == np.uint64(favourite))
        assert share > 0.97, share
        np.testing.assert_allclose(dominated.probabilities[dominated.keys == favourite], 1e3 / (1e3 + 7e-3), rtol=1e-6)


# -- end to end -------------------------------------------------------------------------------------------


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_learner_and_two_actors_on_cartpole_exit_cleanly(tmp_path):
    results = tmp_path / "run"
    command = [
        sys.executable, "experiments/run_dqn.py", *TINY_DQN, "--num_actors", "2", "--actor_bits", "8",
        "--samples_per_insert", "8",
        "--target_update_period", "50", "--max_learner_steps", "300", "--max_seconds", "150",
        "--eval_period", "100", "--publish_period", "10", "--update_period", "50", "--checkpoint_period", "1000",
        "--seed", "3", "--learner_threads", "1", "--results_dir", str(results),
    ]
    completed = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=220)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["exit_code"] == 0
    assert summary["agent"] == "dqn" and summary["task"] == "CartPole-v1"
    assert summary["env_steps"] > 0
    assert summary["learner_steps"] >= 300, summary["learner_steps"]
    assert summary["actor_episodes"] > 0
    assert len(summary["actor_policy_backends"]) == 1 and summary["actor_policy_backends"][0].startswith("int8/w8a8/")
    assert not any("died" in event for event in summary["events"]), summary["events"]
    eval_rows = (results / "eval.csv").read_text().strip().splitlines()
    assert len(eval_rows) >= 3  # header + at least the fp32 and the 8-bit actor policy's final evaluation
    header = (results / "learner.csv").read_text().splitlines()[0].split(",")
    assert "loss" in header and "priorities" not in header  # per-item priorities are written back, not logged
    assert list((results / "actors").glob("actor_*.csv"))
    leftovers = [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftovers, leftovers
    # Workers orphaned by the launcher would be re-parented away from us: find them by their results dir.
    orphans = [p.pid for p in psutil.process_iter(["cmdline"]) if str(results) in " ".join(p.info["cmdline"] or [])]
    assert not orphans, orphans
