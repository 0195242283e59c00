"""D4PG units: the critic loss by hand, learning on a fixed batch, target updates, the policies."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actorq_jax.agents.d4pg import learning
from actorq_jax.agents.d4pg.builder import D4PGBuilder
from actorq_jax.agents.d4pg.config import D4PGConfig
from actorq_jax.environments import EnvironmentSpec
from actorq_jax.replay import ReplayBatch, Transition

OBS_DIM, ACT_DIM = 4, 2


def _spec(low=-1.0, high=1.0) -> EnvironmentSpec:
    return EnvironmentSpec(
        observation_dim=OBS_DIM, discrete=False, action_dim=ACT_DIM, num_actions=None,
        action_minimum=np.full(ACT_DIM, low, np.float32), action_maximum=np.full(ACT_DIM, high, np.float32),
    )


def _tiny_config(**overrides) -> D4PGConfig:
    base = D4PGConfig(policy_layers=(16, 16), critic_layers=(16, 16), batch_size=8, target_update_period=3)
    return dataclasses.replace(base, **overrides)


def _batch(size: int = 8, seed: int = 0) -> Transition:
    rng = np.random.default_rng(seed)
    return Transition(
        observation=rng.normal(size=(size, OBS_DIM)).astype(np.float32),
        action=rng.uniform(-1, 1, size=(size, ACT_DIM)).astype(np.float32),
        reward=rng.normal(size=(size,)).astype(np.float32),
        discount=np.full((size,), 0.9, np.float32),
        next_observation=rng.normal(size=(size, OBS_DIM)).astype(np.float32),
    )


def _sampled(data: Transition) -> ReplayBatch:
    """The transitions as the learner's dataset serves them (uniform sampling info)."""
    size = data.reward.shape[0]
    return ReplayBatch(data=data, keys=np.arange(size, dtype=np.uint64), probabilities=np.full(size, 1.0 / size),
                       table_size=np.full(size, size, np.int64))


def _constant_critic(params, bias):
    """Critic parameters whose logits are `bias` whatever the input (zero head kernel)."""
    head = params["params"]["head"]
    head = {"kernel": jnp.zeros_like(head["kernel"]), "bias": jnp.asarray(bias, jnp.float32)}
    return {"params": {**params["params"], "head": head}}


@pytest.mark.parametrize(
    "reward, discount, expected",
    [
        # Target all at r=0.5 (discount 0): mass 1/2 on atoms 0 and 1; predicted [1/4, 1/2, 1/4].
        (0.5, 0.0, 1.5 * math.log(2.0)),
        # Target atoms [-0.5, 0, 0.5] with [1/4, 1/2, 1/4] project to [1/8, 3/4, 1/8].
        (0.0, 0.5, 1.25 * math.log(2.0)),
    ],
)
def test_critic_loss_matches_hand_computation(reward, discount, expected):
    config = _tiny_config(num_atoms=3, v_min=-1.0, v_max=1.0)
    networks = learning.make_networks(config, _spec())
    state = learning.init_state(config, networks, _spec(), jax.random.PRNGKey(0))
    critic = _constant_critic(state.critic_params, [0.0, math.log(2.0), 0.0])
    batch = _batch(size=4)._replace(reward=np.full(4, reward, np.float32), discount=np.full(4, discount, np.float32))
    loss = learning.critic_loss(critic, critic, state.target_policy_params, networks, batch)
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_critic_loss_and_its_gradient_equal_rlax_categorical_td_learning():
    import rlax

    config = _tiny_config(num_atoms=11, v_min=-3.0, v_max=3.0)
    networks = learning.make_networks(config, _spec())
    state = learning.init_state(config, networks, _spec(), jax.random.PRNGKey(3))
    # Targets that differ from the online critic, and rewards that push some atoms past the support's ends.
    target_critic = jax.tree_util.tree_map(lambda p: p + 0.3, state.critic_params)
    batch = _batch(size=8, seed=5)._replace(reward=np.linspace(-4.0, 4.0, 8).astype(np.float32))

    def reference(critic_params):
        logits_tm1 = networks.critic.apply(critic_params, batch.observation, batch.action)
        next_action = networks.policy.apply(state.target_policy_params, batch.next_observation)
        logits_t = networks.critic.apply(target_critic, batch.next_observation, next_action)
        per_example = jax.vmap(rlax.categorical_td_learning, in_axes=(None, 0, 0, 0, None, 0))(
            networks.atoms, logits_tm1, batch.reward, batch.discount, networks.atoms, logits_t)
        return jnp.mean(per_example)

    def ours(critic_params):
        return learning.critic_loss(critic_params, target_critic, state.target_policy_params, networks, batch)

    want_loss, want_grads = jax.value_and_grad(reference)(state.critic_params)
    got_loss, got_grads = jax.jit(jax.value_and_grad(ours))(state.critic_params)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


def test_sgd_step_lowers_the_loss_on_a_fixed_batch():
    config = _tiny_config(
        critic_learning_rate=1e-3, policy_learning_rate=1e-3, target_update_period=1000, num_atoms=11, v_min=-5.0, v_max=5.0
    )
    builder = D4PGBuilder(config, _spec())
    state = builder.init_state(jax.random.PRNGKey(0))
    # Discount 0: the target is the reward alone, so the loss can fall to at most ln 2 (two atoms).
    batch = _batch()._replace(discount=np.zeros(8, np.float32))
    _, first = builder.sgd_step(state, _sampled(batch))
    for _ in range(200):
        state, metrics = builder.sgd_step(state, _sampled(batch))
    assert float(first["critic_loss"]) > 2.0
    assert float(metrics["critic_loss"]) < 0.5 * float(first["critic_loss"])
    assert np.isfinite(float(metrics["policy_loss"]))


def test_target_parameters_change_exactly_every_target_period():
    period = 3
    builder = D4PGBuilder(_tiny_config(target_update_period=period), _spec())
    state = builder.init_state(jax.random.PRNGKey(0))
    batch = _batch()
    leaf = lambda tree: np.asarray(jax.tree_util.tree_leaves(tree)[0]).copy()  # noqa: E731
    changed_at = []
    for step in range(1, 10):
        before = leaf(state.target_critic_params), leaf(state.target_policy_params)
        state, _ = builder.sgd_step(state, _sampled(batch))
        after = leaf(state.target_critic_params), leaf(state.target_policy_params)
        if not np.array_equal(before[0], after[0]):
            assert not np.array_equal(before[1], after[1])  # both targets move together
            changed_at.append(step)
            # After an update the targets equal the online parameters.
            np.testing.assert_array_equal(after[0], leaf(state.critic_params))
    assert changed_at == [3, 6, 9]


def test_behaviour_actions_inside_spec_and_reproducible():
    spec = _spec(low=-0.25, high=0.5)
    builder = D4PGBuilder(_tiny_config(sigma=5.0), spec)  # huge noise: clipping must hold
    params = builder.actor_params(builder.init_state(jax.random.PRNGKey(0)))
    policy = builder.behaviour_policy(actor_id=0, num_actors=1)
    obs = np.ones(OBS_DIM, np.float32)
    actions = np.stack([np.asarray(policy(params, jax.random.PRNGKey(i), obs)) for i in range(50)])
    assert actions.shape == (50, ACT_DIM)
    assert np.all(actions >= -0.25) and np.all(actions <= 0.5)
    assert len(np.unique(actions[:, 0])) > 2  # noise is applied
    again = np.stack([np.asarray(policy(params, jax.random.PRNGKey(i), obs)) for i in range(50)])
    np.testing.assert_array_equal(actions, again)


def _policy_by_hand(params, obs, low, high, layer_norm):
    """The D4PG policy in numpy: MLP torso (first layer LayerNorm + tanh when layer_norm), tanh head, scaled to bounds."""
    torso, head = params["params"]["torso"], params["params"]["head"]
    x = obs.astype(np.float64)
    for i in range(len(torso) - (1 if layer_norm else 0)):
        dense = torso[f"Dense_{i}"]
        x = x @ np.asarray(dense["kernel"], np.float64) + np.asarray(dense["bias"], np.float64)
        if i == 0 and layer_norm:
            norm = torso["LayerNorm_0"]
            x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)  # flax's default epsilon
            x = np.tanh(x * np.asarray(norm["scale"]) + np.asarray(norm["bias"]))
        else:
            x = np.where(x > 0, x, np.expm1(np.minimum(x, 0))) if layer_norm else np.maximum(x, 0)  # elu / relu
    x = np.tanh(x @ np.asarray(head["kernel"], np.float64) + np.asarray(head["bias"], np.float64))
    return low + (x + 1.0) * 0.5 * (high - low)


@pytest.mark.parametrize("layer_norm", [False, True])
def test_greedy_policy_is_the_policy_network_without_noise(layer_norm):
    low, high = np.array([-0.25, -2.0], np.float32), np.array([0.5, 1.0], np.float32)
    spec = dataclasses.replace(_spec(), action_minimum=low, action_maximum=high)
    builder = D4PGBuilder(_tiny_config(policy_layer_norm=layer_norm, sigma=0.0), spec)
    params = builder.actor_params(builder.init_state(jax.random.PRNGKey(0)))
    # Random weights of unit scale: the initial head is near zero and would put every action at the centre.
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    params = jax.tree_util.tree_unflatten(treedef, [0.5 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
    observations = np.random.default_rng(2).normal(size=(32, OBS_DIM)).astype(np.float32)
    expected = _policy_by_hand(params, observations, low, high, layer_norm)
    greedy = builder.greedy_policy()
    actions = np.stack([np.asarray(greedy(params, o)) for o in observations])
    assert actions.shape == (32, ACT_DIM) and len(np.unique(actions[:, 0])) == 32
    np.testing.assert_allclose(actions, expected, atol=1e-5, rtol=0)
    # With sigma 0 the behaviour policy adds no noise: it is the greedy policy.
    behaviour = builder.behaviour_policy(actor_id=0, num_actors=1)
    noiseless = np.stack([np.asarray(behaviour(params, jax.random.PRNGKey(i), o)) for i, o in enumerate(observations)])
    np.testing.assert_allclose(noiseless, actions, atol=1e-6, rtol=0)


def test_per_actor_sigma_spread_and_config_validation():
    config = D4PGConfig(sigma=0.2, sigma_spread=1.0)
    sigmas = [config.actor_sigma(i, 3) for i in range(3)]
    assert sigmas == pytest.approx([0.1, 0.2, 0.3])
    assert D4PGConfig(sigma=0.2).actor_sigma(2, 3) == 0.2
    with pytest.raises(ValueError, match="discount"):
        D4PGConfig(discount=1.5)
    with pytest.raises(ValueError, match="continuous"):
        D4PGBuilder(D4PGConfig(), EnvironmentSpec(4, True, None, 2, np.int32(0), np.int32(1)))
