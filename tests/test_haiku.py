"""A Haiku policy through the quantization transform, the wire and every actor backend, against its float actions."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actorq_jax import kernels
from actorq_jax.kernels import _library
from actorq_jax.launch.precision import ActorPrecision, make_param_loader
from actorq_jax.networks.haiku_adapter import quantized_apply
from actorq_jax.quantization import QuantConfig, dequantize, from_wire, is_quantized_leaf, quantize, to_wire

OBS_DIM, ACTION_DIM = 24, 6
# Tolerances on actions in [-1, 1] (tanh head) over 512 observations, worst element.
# 8-bit per-channel weights sit within scale / 2 = max|w| / 254 of the float ones;
# through three layers that moved actions by at most ~0.01 when measured (AMD EPYC
# Zen 5, jax 0.4.34); W8A8 also rounds each layer's input per row to 8 bits (~0.016).
FAKEQUANT_8BIT_ATOL = 0.03
INT8_W8A8_ATOL = 0.05
# The kernel against the pure-jnp reference of the same integer math: float summation order only.
KERNEL_VS_REFERENCE_ATOL = 1e-5
# W4A8 against fakequant at 4 bits: the same weights, differing only by the 8-bit activations (~0.014 measured).
W4A8_VS_FAKEQUANT_ATOL = 0.05

needs_kernel = pytest.mark.skipif(not kernels.kernel_available(),
                                  reason=f"int8 kernel not built here: {kernels.describe_kernel()}")


def _policy_fn(observation):
    # An Acme-style deterministic policy: hk.nets.MLP torso, a linear head, tanh.
    torso = hk.nets.MLP([256, 256], activate_final=True)
    return jnp.tanh(hk.Linear(ACTION_DIM)(torso(observation)))


@pytest.fixture(scope="module")
def policy():
    """(transformed policy, float params, observations, float actions)."""
    transformed = hk.without_apply_rng(hk.transform(_policy_fn))
    observations = jax.random.normal(jax.random.PRNGKey(1), (512, OBS_DIM))
    params = transformed.init(jax.random.PRNGKey(0), observations)
    return transformed, params, observations, np.asarray(transformed.apply(params, observations))


def _actor_actions(policy, bits: int, backend: str) -> np.ndarray:
    """Actions of the policy as an actor runs it: quantized at `bits`, over the wire, through the actors' loader."""
    transformed, params, observations, _ = policy
    precision = ActorPrecision(actor_bits=bits, comm_bits=bits, backend=backend)
    template = quantize(params, precision.wire_quant())  # what an actor builds from its network, as `like`
    received, version = from_wire(to_wire(quantize(params, precision.wire_quant()), version=7), like=template)
    assert version == 7
    runnable = make_param_loader(precision)(received)
    return np.asarray(jax.jit(quantized_apply(transformed.apply))(runnable, observations))


def test_haiku_params_are_linear_layers_the_rule_quantizes(policy):
    _, params, _, _ = policy
    assert set(params) == {"mlp/~/linear_0", "mlp/~/linear_1", "linear"}
    q = quantize(params, QuantConfig(bits=8))
    for module in params.values():
        assert set(module) == {"w", "b"}
    # Every "w" is a kernel of at least min_size elements; biases stay float.
    assert all(is_quantized_leaf(q[name]["w"]) and not is_quantized_leaf(q[name]["b"]) for name in params)


def test_float_params_run_exactly_as_haiku_runs_them(policy):
    transformed, params, observations, float_actions = policy
    np.testing.assert_array_equal(np.asarray(quantized_apply(transformed.apply)(params, observations)), float_actions)
    np.testing.assert_array_equal(_actor_actions(policy, 32, "fp32"), float_actions)


@pytest.mark.parametrize("bits", [2, 4, 8, 16, 32])
def test_wire_round_trip_returns_the_haiku_structure(policy, bits):
    _, params, _, _ = policy
    q = quantize(params, QuantConfig(bits=bits))
    back, version = from_wire(to_wire(q, version=3), like=q)
    assert version == 3
    assert type(back) is dict and list(back) == list(q)
    assert all(type(back[name]) is dict and list(back[name]) == list(q[name]) for name in q)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(q)
    for got, want in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(q)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Dequantized, the payload is a float tree of exactly the Haiku params' structure.
    assert jax.tree_util.tree_structure(dequantize(back)) == jax.tree_util.tree_structure(params)


def test_fakequant_8bit_actions_stay_close_to_float(policy):
    actions = _actor_actions(policy, 8, "fakequant")
    assert not np.array_equal(actions, policy[3])  # the weights really were quantized
    np.testing.assert_allclose(actions, policy[3], atol=FAKEQUANT_8BIT_ATOL, rtol=0)


@needs_kernel
@pytest.mark.parametrize("bits, target", [(8, _library.TARGET_W8A8), (4, _library.TARGET_W4A8)])
def test_int8_kernel_runs_the_linear_layers(policy, bits, target, monkeypatch):
    transformed, params, observations, float_actions = policy
    precision = ActorPrecision(actor_bits=bits, comm_bits=bits, backend="int8")
    runnable = make_param_loader(precision)(quantize(params, precision.wire_quant()))
    assert all(isinstance(module["w"], kernels.Int8DenseWeight) for module in runnable.values())
    # All three linear layers are calls of the kernel (W4A8 at 4 bits, as the actors' loader packs them).
    jaxpr = str(jax.make_jaxpr(quantized_apply(transformed.apply))(runnable, observations))
    assert jaxpr.count(target) == 3
    actions = _actor_actions(policy, bits, "int8")
    monkeypatch.setenv(_library.ENV_PATH, "reference")
    reference = np.asarray(jax.jit(quantized_apply(transformed.apply))(runnable, observations))
    np.testing.assert_allclose(actions, reference, atol=KERNEL_VS_REFERENCE_ATOL, rtol=0)
    if bits == 8:
        np.testing.assert_allclose(actions, float_actions, atol=INT8_W8A8_ATOL, rtol=0)
    else:
        fakequant = _actor_actions(policy, bits, "fakequant")
        np.testing.assert_allclose(actions, fakequant, atol=W4A8_VS_FAKEQUANT_ATOL, rtol=0)


def test_layers_other_than_linear_run_in_float_on_int8_params():
    def net(x):
        features = hk.Conv1D(8, 3, name="conv")(x[..., None]).reshape(x.shape[0], -1)
        return hk.nets.MLP([64, 4])(features)

    transformed = hk.without_apply_rng(hk.transform(net))
    observations = jax.random.normal(jax.random.PRNGKey(2), (16, 32))
    params = transformed.init(jax.random.PRNGKey(3), observations)
    q = quantize(params, QuantConfig(bits=8, min_size=16))
    packed = kernels.pack_params(q)  # packs the 2-D linear kernels; the 3-D conv kernel stays a QuantizedTensor
    assert is_quantized_leaf(packed["conv"]["w"]) and isinstance(packed["mlp/~/linear_0"]["w"], kernels.Int8DenseWeight)
    fakequant = np.asarray(transformed.apply(dequantize(q), observations))
    got = np.asarray(jax.jit(quantized_apply(transformed.apply))(packed, observations))
    # W8A32 packing: the same weights as fakequant and float activations, so only summation order differs.
    np.testing.assert_allclose(got, fakequant, atol=1e-4, rtol=0)
