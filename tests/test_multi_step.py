"""multi_sgd_step: n steps in one jitted call equal n calls of the agent's sgd_step, for every agent."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax

from actorq_jax.agents.d4pg import learning as d4pg_learning
from actorq_jax.agents.multi_step import last_step_metrics, multi_sgd_step, stack_batches
from actorq_jax.agents.registry import get_agent
from actorq_jax.environments import EnvironmentSpec
from actorq_jax.networks import categorical_mean
from actorq_jax.replay import ReplayBatch, Transition

OBS_DIM, ACT_DIM, NUM_ACTIONS, BATCH, STEPS = 4, 2, 3, 8, 5


def _builder(agent: str):
    """A tiny builder of the agent whose target networks update inside the scanned steps."""
    entry = get_agent(agent)
    if agent == "d4pg":
        config = entry.config_class(policy_layers=(16, 16), critic_layers=(16, 16), batch_size=BATCH,
                                    target_update_period=2)
        spec = EnvironmentSpec(OBS_DIM, False, ACT_DIM, None, np.full(ACT_DIM, -1.0, np.float32),
                               np.full(ACT_DIM, 1.0, np.float32))
    else:
        config = entry.config_class(q_layers=(16, 16), batch_size=BATCH, target_update_period=2, min_replay_size=1)
        spec = EnvironmentSpec(OBS_DIM, True, None, NUM_ACTIONS, np.asarray(0, np.int32),
                               np.asarray(NUM_ACTIONS - 1, np.int32))
    return entry.make_builder(config, spec)


def _batch(builder, seed: int) -> ReplayBatch:
    """A sampled batch as ReplayDataset(with_info=True) serves it, with non-uniform probabilities."""
    rng = np.random.default_rng(seed)
    if builder.spec.discrete:
        action = rng.integers(0, NUM_ACTIONS, size=BATCH).astype(np.int32)
    else:
        action = rng.uniform(-1, 1, size=(BATCH, ACT_DIM)).astype(np.float32)
    data = Transition(
        observation=rng.normal(size=(BATCH, OBS_DIM)).astype(np.float32),
        action=action,
        reward=rng.normal(size=BATCH).astype(np.float32),
        discount=rng.choice([0.0, 0.9], size=BATCH).astype(np.float32),
        next_observation=rng.normal(size=(BATCH, OBS_DIM)).astype(np.float32),
    )
    probabilities = rng.uniform(0.5, 1.5, size=BATCH)
    return ReplayBatch(data=data, keys=rng.integers(0, 2**63, size=BATCH, dtype=np.uint64),
                       probabilities=probabilities / probabilities.sum(), table_size=np.full(BATCH, 100, np.int64))


def _assert_trees_close(actual, expected) -> None:
    jax.tree_util.tree_map(
        lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-6), actual, expected)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("agent", ["d4pg", "dqn"])
def test_n_steps_in_one_call_equal_n_single_steps(agent, donate):
    builder = _builder(agent)
    batches = [_batch(builder, seed) for seed in range(STEPS)]
    state = builder.init_state(jax.random.PRNGKey(0))
    expected_metrics = []
    expected = state
    for batch in batches:
        expected, metrics = builder.sgd_step(expected, batch)
        expected_metrics.append(metrics)

    run = multi_sgd_step(builder.sgd_step, STEPS, donate=donate)
    start = jax.tree_util.tree_map(jnp.copy, state) if donate else state
    got, metrics = run(start, stack_batches(batches))

    assert int(got.steps) == STEPS
    # Donation hands the input buffers to the output: the old state is gone, as the docstring warns.
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(start)) == donate
    _assert_trees_close(got, expected)
    # Metrics are stacked per step: step i's are the i-th call's.
    assert set(metrics) == set(expected_metrics[0])
    for name, values in metrics.items():
        assert values.shape[0] == STEPS
        for i in range(STEPS):
            np.testing.assert_allclose(values[i], expected_metrics[i][name], rtol=1e-5, atol=1e-6)
    _assert_trees_close(last_step_metrics(metrics), expected_metrics[-1])
    # The steps did train (the comparison is not between two untouched states).
    assert not np.allclose(np.asarray(jax.tree_util.tree_leaves(got)[0]), jax.tree_util.tree_leaves(state)[0])


def test_priority_update_of_a_stacked_call_writes_every_step_newest_last():
    builder = _builder("dqn")
    batches = [_batch(builder, seed) for seed in range(STEPS)]
    stacked = stack_batches(batches)
    _, metrics = multi_sgd_step(builder.sgd_step, STEPS)(builder.init_state(jax.random.PRNGKey(1)), stacked)
    update = builder.priority_update(stacked, metrics)
    assert update.keys.shape == update.priorities.shape == (STEPS, BATCH)
    np.testing.assert_array_equal(update.keys[-1], batches[-1].keys)
    assert np.all(np.isfinite(update.priorities)) and np.all(update.priorities >= 0)
    # The uniform agent writes nothing back.
    d4pg = _builder("d4pg")
    stacked = stack_batches([_batch(d4pg, seed) for seed in range(2)])
    _, metrics = multi_sgd_step(d4pg.sgd_step, 2)(d4pg.init_state(jax.random.PRNGKey(1)), stacked)
    assert d4pg.priority_update(stacked, metrics) is None


def test_stacked_batch_must_match_the_step_count():
    builder = _builder("d4pg")
    run = multi_sgd_step(builder.sgd_step, 3)
    with pytest.raises(ValueError, match="leading axis of 3"):
        run(builder.init_state(jax.random.PRNGKey(0)), stack_batches([_batch(builder, s) for s in range(2)]))
    with pytest.raises(ValueError, match="num_steps"):
        multi_sgd_step(builder.sgd_step, 0)
    with pytest.raises(ValueError, match="at least one"):
        stack_batches([])


def test_d4pg_policy_gradient_equals_the_one_through_dpg_loss_own_stop():
    # The explicit stop_gradient on dQ/da only skips work: dpg_loss already holds its target constant.
    builder = _builder("d4pg")
    state = builder.init_state(jax.random.PRNGKey(2))
    networks, observation = builder.networks, _batch(builder, 0).data.observation

    def without_explicit_stop(policy_params, critic_params):
        action = networks.policy.apply(policy_params, observation)
        dqda = jax.grad(lambda a: jnp.sum(categorical_mean(networks.critic.apply(critic_params, observation, a),
                                                           networks.atoms)))(action)
        return jnp.mean(jnp.sum(jax.vmap(rlax.dpg_loss)(action, dqda), axis=-1))

    expected = jax.grad(without_explicit_stop)(state.policy_params, state.critic_params)
    got = jax.grad(d4pg_learning.policy_loss)(state.policy_params, state.critic_params, networks, observation)
    _assert_trees_close(got, expected)

