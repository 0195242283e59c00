"""Networks: actions inside the spec, a normalised critic distribution, 8-bit policies close to float."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actorq_jax.config import parse_int_tuple as parse_layer_sizes
from actorq_jax.networks import CriticNetwork, PolicyNetwork, QNetwork, categorical_mean, value_atoms
from actorq_jax.quantization import QuantConfig, dequantize, quantize

LOW = (-1.0, -0.5, 0.0)
HIGH = (1.0, 2.0, 3.0)


def _policy(layer_norm: bool) -> PolicyNetwork:
    return PolicyNetwork(action_dim=3, layer_sizes=(64, 64), layer_norm=layer_norm, action_minimum=LOW, action_maximum=HIGH)


@pytest.mark.parametrize("layer_norm", [False, True])
def test_policy_actions_lie_inside_the_action_spec(layer_norm):
    policy = _policy(layer_norm)
    obs = jax.random.normal(jax.random.PRNGKey(1), (256, 7)) * 50.0  # large inputs push tanh to its limits
    params = policy.init(jax.random.PRNGKey(0), obs)
    # Scale the head up so actions reach the bounds rather than sitting at the centre.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 1e4 if "head" in jax.tree_util.keystr(path) else x, params
    )
    actions = np.asarray(policy.apply(params, obs))
    assert actions.shape == (256, 3)
    assert np.all(actions >= np.array(LOW) - 1e-6) and np.all(actions <= np.array(HIGH) + 1e-6)
    unit = (actions - np.array(LOW)) / (np.array(HIGH) - np.array(LOW))
    assert unit.min() < 0.05 and unit.max() > 0.95  # the bounds are actually reached


def test_critic_distribution_sums_to_one_and_mean_lies_in_support():
    critic = CriticNetwork(layer_sizes=(32, 32), num_atoms=11)
    obs, act = jnp.ones((5, 4)), jnp.zeros((5, 2))
    params = critic.init(jax.random.PRNGKey(0), obs, act)
    logits = critic.apply(params, obs, act)
    probs = jax.nn.softmax(logits, axis=-1)
    np.testing.assert_allclose(np.asarray(probs.sum(-1)), 1.0, rtol=1e-6)
    atoms = value_atoms(-10.0, 10.0, 11)
    means = np.asarray(categorical_mean(logits, atoms))
    assert np.all(means >= -10.0) and np.all(means <= 10.0)


def test_eight_bit_policy_stays_close_to_float_policy():
    policy = PolicyNetwork(action_dim=6, layer_sizes=(256, 256, 256), action_minimum=(-1.0,) * 6, action_maximum=(1.0,) * 6)
    obs = jax.random.normal(jax.random.PRNGKey(3), (512, 24))
    params = policy.init(jax.random.PRNGKey(2), obs)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 1e3 if "head" in jax.tree_util.keystr(path) else x, params
    )
    float_actions = np.asarray(policy.apply(params, obs))
    q = quantize(params, QuantConfig(bits=8, min_size=64))
    q_actions = np.asarray(policy.apply(q, obs))  # QuantizedTensor kernels apply directly
    fq_actions = np.asarray(policy.apply(dequantize(q), obs))
    np.testing.assert_allclose(q_actions, fq_actions, atol=1e-5)
    err = np.abs(q_actions - float_actions)
    # Measured here: 8 bits max 0.077, mean 0.0038; 4 bits max 1.5, mean 0.069 (actions span [-1, 1]).
    assert float_actions.std() > 0.3
    assert err.max() < 0.1 and err.mean() < 0.02
    # And 4 bits is clearly worse than 8: the bound above is not vacuous.
    err4 = np.abs(np.asarray(policy.apply(quantize(params, QuantConfig(bits=4, min_size=64)), obs)) - float_actions)
    assert err4.mean() > 3 * err.mean()


def test_q_network_and_paper_sized_policy_shapes():
    q = QNetwork(num_actions=3, layer_sizes=(2048, 2048, 2048))
    shapes = jax.eval_shape(q.init, jax.random.PRNGKey(0), jnp.zeros((1, 4)))
    assert shapes["params"]["torso"]["Dense_2"]["kernel"].shape == (2048, 2048)
    big = PolicyNetwork(action_dim=6, layer_sizes=(4096, 4096, 4096))
    shapes = jax.eval_shape(big.init, jax.random.PRNGKey(0), jnp.zeros((1, 24)))
    assert shapes["params"]["torso"]["Dense_1"]["kernel"].shape == (4096, 4096)


@pytest.mark.parametrize("text", ["", "256,", "a,b", "0,3", "-1"])
def test_malformed_layer_lists_are_rejected(text):
    with pytest.raises(ValueError, match="malformed list"):
        parse_layer_sizes(text)
    assert parse_layer_sizes("256, 128") == (256, 128)


def test_elu_has_jax_nn_elus_values_and_derivatives_and_a_finite_gradient_at_large_inputs():
    from actorq_jax.activations import elu

    x = jnp.array([-200.0, -30.0, -1.0, -1e-3, -1e-8, 0.0, 1e-8, 1e-3, 1.0, 30.0, 100.0, 200.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(elu)(x)), np.asarray(jax.jit(jax.nn.elu)(x)))
    ours = jax.jit(jax.vmap(jax.grad(elu)))(x)
    theirs = jax.jit(jax.vmap(jax.grad(jax.nn.elu)))(x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert np.all(np.isfinite(np.asarray(ours)))
    # Second derivative too (the policy gradient differentiates through the critic): exp(x) below 0, 0 above.
    second = np.asarray(jax.jit(jax.vmap(jax.grad(jax.grad(elu))))(x))
    np.testing.assert_array_equal(second, np.asarray(jax.jit(jax.vmap(jax.grad(jax.grad(jax.nn.elu))))(x)))
    np.testing.assert_allclose(second[2:5], np.exp(np.asarray(x[2:5])), rtol=1e-6)
    assert np.all(second[6:] == 0.0)
    # Inside a layer (where XLA fuses it into the matmul), values and gradients within float32 round-off of jax.nn.elu.
    w = jax.random.normal(jax.random.PRNGKey(0), (64, 64)) / 8.0
    inputs = jax.random.normal(jax.random.PRNGKey(1), (32, 64)) * 20.0

    def loss(act, w):
        return jnp.sum(act(act(inputs @ w) @ w) ** 2)

    np.testing.assert_allclose(jax.jit(lambda w: loss(elu, w))(w), jax.jit(lambda w: loss(jax.nn.elu, w))(w), rtol=1e-5)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda w: loss(elu, w)))(w), jax.jit(jax.grad(lambda w: loss(jax.nn.elu, w)))(w),
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    "rows, inner, outer, split",
    [
        (256, 256, 51, True),  # the critic head at batch 256: between oneDNN's batched and 2-D thresholds
        (256, 512, 512, False),  # already over the 2-D threshold
        (256, 6, 512, False),  # a thin operand
        (255, 256, 51, False),  # odd rows do not halve
        (8, 256, 51, False),  # an actor's batch: under the batched threshold
        (16, 512, 512, False),  # 16 environments against a wide layer: in the range, but too few rows
        (64, 256, 256, True),  # the fewest rows split
    ],
)
def test_float_matmul_splits_only_mid_sized_dots_and_equals_jnp_dot_with_its_gradients(rows, inner, outer, split):
    from actorq_jax.networks import layers

    x = jax.random.normal(jax.random.PRNGKey(0), (rows, inner))
    kernel = jax.random.normal(jax.random.PRNGKey(1), (inner, outer))
    dims = [eqn.params["dimension_numbers"] for eqn in jax.make_jaxpr(layers.float_matmul)(x, kernel).eqns
            if eqn.primitive.name == "dot_general"]
    batched = [batch for (_, batch) in dims if batch[0]]
    assert len(dims) == 1 and bool(batched) == split

    def loss(fn):
        return lambda a, b: jnp.sum(jnp.sin(fn(a, b)))

    np.testing.assert_allclose(layers.float_matmul(x, kernel), jnp.dot(x, kernel), rtol=1e-5, atol=1e-4)
    got = jax.grad(loss(layers.float_matmul), argnums=(0, 1))(x, kernel)
    want = jax.grad(loss(jnp.dot), argnums=(0, 1))(x, kernel)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)
