"""Tests of actorq_jax.quantization: numerics, the leaf rule, STE, wire format."""

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from launch_support import BENCHMARKS, ROOT

from actorq_jax.quantization import (
    QuantConfig,
    QuantizedTensor,
    dequantize,
    dequantize_tensor,
    fake_quant,
    from_wire,
    is_quantized_leaf,
    quantize,
    quantized_shapes,
    to_wire,
    wire_nbytes,
)
from actorq_jax.quantization.wire import pack_values, unpack_values, wire_meta

INT_BITS = list(range(2, 9))
GRANULARITIES = ["per_channel", "per_tensor"]


# ----------------------------------------------------------------------------- helpers

def kernel(shape, seed=0, channel_spread=True):
    """A float32 kernel whose output channels have very different magnitudes."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    if channel_spread:
        w *= np.logspace(-3, 1, shape[-1], dtype=np.float32)
    return w


def small_net(seed=0):
    """A flax-style tree: Dense kernels, biases, a LayerNorm, a small kernel, a conv."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return {"params": {
        "Conv_0": {"kernel": f(3, 3, 4, 40), "bias": f(40)},
        "Dense_0": {"kernel": f(37, 64), "bias": f(64)},
        "Dense_1": {"kernel": f(64, 65), "bias": f(65)},
        "LayerNorm_0": {"scale": f(65), "bias": f(65)},
        "head": {"kernel": f(65, 3), "bias": f(3)},  # 195 < min_size: stays float32
    }}


def broadcast_scale(qt):
    return np.broadcast_to(np.asarray(qt.scale), qt.shape)


def numpy_quantize(w, bits, granularity, symmetric):
    """Independent numpy reference of the quantizer documented in QuantConfig."""
    w = np.asarray(w, np.float32)
    axes = tuple(range(w.ndim - 1)) if granularity == "per_channel" else None
    tiny = np.finfo(np.float32).tiny
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = (np.abs(w).max(axis=axes) * np.float32(1.0 / qmax)).astype(np.float32)
        scale = np.where(scale >= tiny, scale, np.float32(1)).astype(np.float32)
        q = np.clip(np.round(w / scale), -qmax, qmax).astype(np.int8)
        return q, scale, None
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    lo = np.minimum(w.min(axis=axes), np.float32(0))
    hi = np.maximum(w.max(axis=axes), np.float32(0))
    scale = ((hi - lo) * np.float32(1.0 / (qmax - qmin))).astype(np.float32)
    scale = np.where(scale >= tiny, scale, np.float32(1)).astype(np.float32)
    zp = np.clip(qmin - np.round(lo / scale), qmin, qmax).astype(np.float32)
    q = np.clip(np.round(w / scale) + zp, qmin, qmax).astype(np.int8)
    return q, scale, zp.astype(np.int32)


def numpy_dequantize(q, scale, zp):
    if zp is None:
        return q.astype(np.float32) * scale
    return (q.astype(np.int32) - zp).astype(np.float32) * scale


def assert_bit_exact(a, b):
    """Same tree structure, leaf types, dtypes, shapes, bits and bytes."""
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=is_quantized_leaf)
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=is_quantized_leaf)
    assert ta == tb
    for x, y in zip(la, lb):
        assert is_quantized_leaf(x) == is_quantized_leaf(y)
        if is_quantized_leaf(x):
            assert x.bits == y.bits
            assert (x.zero_point is None) == (y.zero_point is None)
            pairs = [(x.values, y.values), (x.scale, y.scale)]
            if x.zero_point is not None:
                pairs.append((x.zero_point, y.zero_point))
        else:
            pairs = [(x, y)]
        for u, v in pairs:
            u, v = np.asarray(u), np.asarray(v)
            assert u.dtype == v.dtype and u.shape == v.shape
            assert u.tobytes() == v.tobytes()


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs, field", [
    (dict(bits=1), "bits"), (dict(bits=12), "bits"), (dict(bits=0), "bits"),
    (dict(bits=9), "bits"), (dict(bits=64), "bits"), (dict(bits="8"), "bits"),
    (dict(bits=8.0), "bits"), (dict(bits=True), "bits"),
    (dict(granularity="per_row"), "granularity"), (dict(granularity="channel"), "granularity"),
    (dict(half="fp8"), "half"), (dict(half="float16"), "half"),
    (dict(symmetric="yes"), "symmetric"), (dict(min_size=-1), "min_size"),
    (dict(min_size=1.5), "min_size"),
])
def test_invalid_config_raises_naming_field_and_value(kwargs, field):
    with pytest.raises(ValueError) as e:
        QuantConfig(**kwargs)
    msg = str(e.value)
    assert field in msg and repr(kwargs[field]) in msg


def test_valid_configs_are_hashable_and_frozen():
    configs = [QuantConfig(bits=b, granularity=g, symmetric=s, half=h)
               for b in INT_BITS + [16, 32] for g in GRANULARITIES
               for s in (True, False) for h in ("bf16", "fp16")]
    assert len(set(configs)) == len(configs)
    assert QuantConfig() == QuantConfig(bits=8, granularity="per_channel", symmetric=True,
                                        half="bf16", min_size=1024)
    with pytest.raises(dataclasses.FrozenInstanceError):
        QuantConfig().bits = 4


# ----------------------------------------------------------------------------- numerics

@pytest.mark.parametrize("bits", INT_BITS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_within_half_step_and_in_range(bits, granularity, symmetric):
    w = kernel((96, 48), seed=bits)
    cfg = QuantConfig(bits=bits, granularity=granularity, symmetric=symmetric, min_size=0)
    qt = quantize({"k": w}, cfg)["k"]
    assert isinstance(qt, QuantizedTensor) and qt.bits == bits
    assert qt.values.dtype == jnp.int8 and qt.values.shape == w.shape
    assert qt.scale.dtype == jnp.float32
    assert qt.scale.shape == ((48,) if granularity == "per_channel" else ())
    q = np.asarray(qt.values)
    if symmetric:
        assert qt.zero_point is None
        lo, hi = -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
        # the largest |w| of a channel lands exactly on +-qmax
        assert np.abs(q).max() == hi
    else:
        assert qt.zero_point.dtype == jnp.int32 and qt.zero_point.shape == qt.scale.shape
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        zp = np.asarray(qt.zero_point)
        assert zp.min() >= lo and zp.max() <= hi
        assert q.min() == lo and q.max() == hi  # the full range is used
    assert q.min() >= lo and q.max() <= hi
    step = broadcast_scale(qt)
    err = np.abs(np.asarray(dequantize_tensor(qt)) - w)
    assert np.all(err <= step * (0.5 + 1e-5)), float((err / step).max())
    # and the error really is of the order of the step (the bound is not vacuous)
    assert (err / step).max() > 0.4


@pytest.mark.parametrize("bits", INT_BITS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_agrees_with_independent_numpy_implementation(bits, granularity, symmetric):
    w = kernel((3, 3, 16, 24), seed=100 + bits)
    w[0, 0, 0, :] = 0.0
    cfg = QuantConfig(bits=bits, granularity=granularity, symmetric=symmetric, min_size=0)
    qt = quantize({"k": w}, cfg)["k"]
    q_ref, s_ref, zp_ref = numpy_quantize(w, bits, granularity, symmetric)
    np.testing.assert_array_equal(np.asarray(qt.scale), s_ref)
    np.testing.assert_array_equal(np.asarray(qt.values), q_ref)
    if symmetric:
        assert qt.zero_point is None
    else:
        np.testing.assert_array_equal(np.asarray(qt.zero_point), zp_ref)
    np.testing.assert_array_equal(np.asarray(dequantize_tensor(qt)),
                                  numpy_dequantize(q_ref, s_ref, zp_ref))


@pytest.mark.parametrize("bits", INT_BITS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_zero_is_exact(bits, symmetric):
    w = kernel((64, 32), seed=7)
    w[::3] = 0.0
    w[:, 5] = 0.0
    cfg = QuantConfig(bits=bits, symmetric=symmetric, min_size=0)
    dq = np.asarray(dequantize(quantize({"k": w}, cfg))["k"])
    assert np.all(dq[w == 0.0] == 0.0)


@pytest.mark.parametrize("bits", INT_BITS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_constant_zero_and_tiny_tensors_are_finite(bits, granularity, symmetric):
    cfg = QuantConfig(bits=bits, granularity=granularity, symmetric=symmetric, min_size=0)
    mixed = kernel((32, 8), seed=1)
    mixed[:, 0] = 0.0      # an all-zero channel
    mixed[:, 1] = 0.75     # a constant channel
    mixed[:, 2] = -2.5
    mixed[:, 3] = 1e-40    # denormal: its scale would flush to zero
    tree = {
        "zeros": np.zeros((32, 8), np.float32),
        "const": np.full((32, 8), 3.0, np.float32),
        "neg_const": np.full((32, 8), -0.1, np.float32),
        "denormal": np.full((32, 8), 1e-42, np.float32),
        "mixed": mixed,
    }
    q = quantize(tree, cfg)
    dq = dequantize(q)
    for name, w in tree.items():
        qt = q[name]
        scale = np.asarray(qt.scale)
        assert np.all(np.isfinite(scale)) and np.all(scale > 0), name
        out = np.asarray(dq[name])
        assert np.all(np.isfinite(out)), name
        assert np.all(np.abs(out - w) <= broadcast_scale(qt) * (0.5 + 1e-5)), name
    np.testing.assert_array_equal(np.asarray(dq["zeros"]), 0.0)
    np.testing.assert_allclose(np.asarray(dq["const"]), 3.0, rtol=1e-6)
    if granularity == "per_channel":
        np.testing.assert_array_equal(np.asarray(dq["mixed"])[:, 0], 0.0)
        np.testing.assert_allclose(np.asarray(dq["mixed"])[:, 1], 0.75, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(dq["mixed"])[:, 2], -2.5, rtol=1e-6)


# ----------------------------------------------------------------------------- the leaf rule

def test_min_size_rule_and_structure():
    params = small_net()
    q = quantize(params, QuantConfig(bits=8))
    p = q["params"]
    for layer in ("Conv_0", "Dense_0", "Dense_1"):
        assert is_quantized_leaf(p[layer]["kernel"]), layer
        assert p[layer]["bias"].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(p[layer]["bias"]), params["params"][layer]["bias"])
    assert p["Conv_0"]["kernel"].scale.shape == (40,)  # per output channel (last axis)
    assert p["LayerNorm_0"]["scale"].dtype == jnp.float32
    assert not is_quantized_leaf(p["head"]["kernel"])  # 65*3 < min_size
    np.testing.assert_array_equal(np.asarray(p["head"]["kernel"]), params["params"]["head"]["kernel"])

    # min_size=0 quantizes the small kernel too, but never a 1-D leaf.
    q0 = quantize(params, QuantConfig(bits=8, min_size=0))["params"]
    assert is_quantized_leaf(q0["head"]["kernel"])
    assert not is_quantized_leaf(q0["LayerNorm_0"]["scale"])
    assert not is_quantized_leaf(q0["Dense_0"]["bias"])

    dq = dequantize(q)
    assert jax.tree_util.tree_structure(dq) == jax.tree_util.tree_structure(params)
    for leaf in jax.tree_util.tree_leaves(dq):
        assert leaf.dtype == jnp.float32


@pytest.mark.parametrize("half, dtype", [("bf16", jnp.bfloat16), ("fp16", jnp.float16)])
def test_half_precision(half, dtype):
    params = small_net()
    q = quantize(params, QuantConfig(bits=16, half=half))["params"]
    assert q["Dense_1"]["kernel"].dtype == dtype and not is_quantized_leaf(q["Dense_1"]["kernel"])
    assert q["Dense_1"]["bias"].dtype == jnp.float32
    assert q["head"]["kernel"].dtype == jnp.float32
    w = params["params"]["Dense_1"]["kernel"]
    np.testing.assert_array_equal(np.asarray(q["Dense_1"]["kernel"]), w.astype(dtype))
    dq = dequantize({"params": q})["params"]["Dense_1"]["kernel"]
    assert dq.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(dq), w, rtol=2 ** -7 if half == "bf16" else 2 ** -10)


def test_bits32_is_float32_unchanged():
    params = small_net()
    params["params"]["Dense_0"]["bias"] = params["params"]["Dense_0"]["bias"].astype(np.float16)
    params["step"] = np.array(7, np.int32)
    q = quantize(params, QuantConfig(bits=32))
    assert jax.tree_util.tree_structure(q) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(q), jax.tree_util.tree_leaves(params)):
        if np.issubdtype(b.dtype, np.floating):
            assert a.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(a), b.astype(np.float32))
        else:
            assert a.dtype == b.dtype and np.array_equal(a, b)
    dq = dequantize(q)
    for a, b in zip(jax.tree_util.tree_leaves(dq), jax.tree_util.tree_leaves(q)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_quantize_traces_inside_jit():
    params = small_net()
    cfg = QuantConfig(bits=4)

    @jax.jit
    def roundtrip(p):
        return dequantize(quantize(p, cfg))

    a = roundtrip(params)
    b = dequantize(quantize(params, cfg))
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------- fake quant

@pytest.mark.parametrize("bits", [2, 4, 8, 16, 32])
def test_fake_quant_equals_dequantize_quantize_and_ste_gradient_is_identity(bits):
    params = small_net(seed=3)
    cfg = QuantConfig(bits=bits, min_size=256)
    fq = fake_quant(params, cfg)
    ref = dequantize(quantize(params, cfg))
    for a, b in zip(jax.tree_util.tree_leaves(fq), jax.tree_util.tree_leaves(ref)):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if bits < 16:
        k = params["params"]["Dense_1"]["kernel"]
        assert not np.array_equal(np.asarray(fq["params"]["Dense_1"]["kernel"]), k)

    weights = jax.tree_util.tree_map(
        lambda x: jnp.asarray(np.random.default_rng(x.size).standard_normal(x.shape), jnp.float32),
        params)

    def loss(p):
        out = fake_quant(p, cfg)
        return sum(jnp.sum(o * w) for o, w in zip(jax.tree_util.tree_leaves(out),
                                                   jax.tree_util.tree_leaves(weights)))

    grads = jax.grad(loss)(params)
    for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(weights)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # and under jit / value_and_grad as a QAT step would use it
    val, grads2 = jax.jit(jax.value_and_grad(loss))(params)
    assert np.isfinite(float(val))
    for g, w in zip(jax.tree_util.tree_leaves(grads2), jax.tree_util.tree_leaves(weights)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# ----------------------------------------------------------------------------- bit packing

@pytest.mark.parametrize("bits", INT_BITS)
def test_packing_layout_matches_a_reference_bitstream(bits):
    rng = np.random.default_rng(bits)
    m = 2 ** (bits - 1)
    for n in (0, 1, 5, 8, 9, 23, 1000, 4099):
        q = rng.integers(-m, m, n).astype(np.int8)
        packed = pack_values(q, bits)
        assert packed.dtype == np.uint8 and packed.size == (n * bits + 7) // 8
        # reference: offset binary (bits < 8) or raw int8 (bits == 8), LSB-first bitstream
        u = (q.astype(np.int16) + m).astype(np.uint8) if bits < 8 else q.view(np.uint8)
        stream = ((u[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
        np.testing.assert_array_equal(packed, np.packbits(stream, bitorder="little"))
        np.testing.assert_array_equal(unpack_values(packed, n, bits), q)


# ----------------------------------------------------------------------------- wire format

WIRE_CASES = ([QuantConfig(bits=b, granularity=g, symmetric=s, min_size=256)
               for b in INT_BITS for g in GRANULARITIES for s in (True, False)]
              + [QuantConfig(bits=16, half="bf16"), QuantConfig(bits=16, half="fp16"),
                 QuantConfig(bits=32)])


@pytest.mark.parametrize("cfg", WIRE_CASES, ids=lambda c: f"b{c.bits}-{c.granularity}-"
                         f"{'sym' if c.symmetric else 'asym'}-{c.half}")
def test_wire_round_trip_is_bit_exact(cfg):
    params = small_net(seed=cfg.bits)
    q = quantize(params, cfg)
    arrays = to_wire(q, version=123456789)
    assert isinstance(arrays, list) and all(isinstance(a, np.ndarray) for a in arrays)
    assert arrays[0].dtype == np.uint8
    assert all(a.ndim == 1 for a in arrays)
    header = json.loads(arrays[0].tobytes())
    assert header["version"] == 123456789 and header["num_arrays"] == len(arrays)
    back, version = from_wire(arrays, like=params)
    assert version == 123456789
    assert_bit_exact(back, q)
    assert_bit_exact(dequantize(back), dequantize(q))
    # the payload survives a copy (as Reverb would deliver it) too
    back2, _ = from_wire([np.array(a, copy=True) for a in arrays])
    assert_bit_exact(back2, q)


def test_wire_carries_nested_lists_and_other_dtypes():
    tree = {"layers": [{"w": kernel((40, 32))}, {"w": kernel((32, 8), seed=2)}],
            "step": np.array(11, np.int32), "mask": np.array([True, False]),
            "nothing": {}, "none_list": []}
    q = quantize(tree, QuantConfig(bits=3, min_size=0))
    back, v = from_wire(to_wire(q))
    assert v == 0
    assert back["nothing"] == {} and back["none_list"] == []
    assert isinstance(back["layers"], list) and len(back["layers"]) == 2
    assert_bit_exact(back["layers"], q["layers"])
    assert back["step"].dtype == jnp.int32 and int(back["step"]) == 11
    np.testing.assert_array_equal(np.asarray(back["mask"]), [True, False])
    # a single QuantizedTensor is a tree too
    qt = q["layers"][0]["w"]
    qt_back, _ = from_wire(to_wire(qt, version=3))
    assert_bit_exact(qt_back, qt)


def test_payload_shrinks_with_bits_on_a_2048x3_policy():
    rng = np.random.default_rng(0)
    sizes = [24, 2048, 2048, 2048, 6]
    params = {"params": {f"Dense_{i}": {
        "kernel": (rng.standard_normal((a, b), dtype=np.float32) / np.sqrt(a)),
        "bias": np.zeros(b, np.float32)} for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}}
    full = wire_nbytes(to_wire(quantize(params, QuantConfig(bits=32))))
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert full >= 4 * n
    sizes_seen = {}
    for bits in INT_BITS + [16]:
        arrays = to_wire(quantize(params, QuantConfig(bits=bits)))
        ratio = wire_nbytes(arrays) / full
        sizes_seen[bits] = ratio
        assert ratio == pytest.approx(bits / 32, rel=0.05), (bits, ratio)
        assert ratio >= bits / 32  # overhead (scales, biases, header) is never negative
    assert all(sizes_seen[b] < sizes_seen[b + 1] for b in range(2, 8))
    assert wire_nbytes(arrays) == sum(a.nbytes for a in arrays)


def test_mismatched_payload_names_the_leaf():
    net = {"params": {"Dense_0": {"kernel": np.zeros((8, 64), np.float32), "bias": np.zeros(64, np.float32)},
                      "Dense_1": {"kernel": np.zeros((64, 32), np.float32), "bias": np.zeros(32, np.float32)}}}
    cfg = QuantConfig(bits=4, min_size=0)
    arrays = to_wire(quantize(net, cfg))
    other = jax.tree_util.tree_map(lambda x: x, net)
    other["params"]["Dense_1"]["kernel"] = np.zeros((64, 64), np.float32)
    with pytest.raises(ValueError, match=r"params/Dense_1/kernel: payload shape \(64, 32\) != "
                                         r"network shape \(64, 64\)"):
        from_wire(arrays, like=other)
    bigger = {"params": dict(net["params"], Dense_2={"kernel": np.zeros((32, 2), np.float32)})}
    with pytest.raises(ValueError, match="params/Dense_2/kernel: in the network but not in the payload"):
        from_wire(arrays, like=bigger)
    smaller = {"params": {"Dense_0": net["params"]["Dense_0"]}}
    with pytest.raises(ValueError, match="params/Dense_1/bias: in the payload but not in the network"):
        from_wire(arrays, like=smaller)
    # like may be the quantized tree itself, or shape structs
    from_wire(arrays, like=quantize(net, cfg))
    from_wire(arrays, like=jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), net))


@pytest.mark.parametrize("bits", [4, 8, 16, 32])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantized_shapes_of_a_shape_only_template_are_what_quantize_returns(bits, granularity):
    # What actors and the evaluator check payloads against: the network's eval_shape'd init, never computed.
    cfg = QuantConfig(bits=bits, granularity=granularity)
    net = {"params": {"Dense_0": {"kernel": jnp.ones((8, 64)), "bias": jnp.zeros(64)},
                      "Dense_1": {"kernel": jnp.ones((64, 32)), "bias": jnp.zeros(32)}}}
    template = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), net)
    shapes = quantized_shapes(template, cfg)
    real = quantize(net, cfg)
    flat_shapes, tree_shapes = jax.tree_util.tree_flatten(shapes)
    flat_real, tree_real = jax.tree_util.tree_flatten(real)
    assert tree_shapes == tree_real
    assert all(isinstance(s, jax.ShapeDtypeStruct) for s in flat_shapes)
    assert [(s.shape, s.dtype) for s in flat_shapes] == [(np.shape(r), r.dtype) for r in flat_real]
    back, version = from_wire(to_wire(real, version=3), like=shapes)
    assert version == 3 and jax.tree_util.tree_structure(back) == tree_real
    for a, b in zip(jax.tree_util.tree_leaves(back), flat_real):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    wider = dict(template["params"], Dense_1={"kernel": jax.ShapeDtypeStruct((64, 48), jnp.float32),
                                              "bias": jax.ShapeDtypeStruct((48,), jnp.float32)})
    with pytest.raises(ValueError, match=r"params/Dense_1/kernel: payload shape \(64, 32\) != network shape \(64, 48\)"):
        from_wire(to_wire(real), like=quantized_shapes({"params": wider}, cfg))


def _header(arrays):
    return json.loads(arrays[0].tobytes())


def _with_header(arrays, header):
    raw = np.frombuffer(json.dumps(header).encode(), np.uint8)
    return [raw] + list(arrays[1:])


def test_malformed_payloads_raise_value_error():
    net = small_net()
    arrays = to_wire(quantize(net, QuantConfig(bits=5, min_size=0)), version=4)
    h = _header(arrays)
    qi = next(i for i, e in enumerate(h["leaves"]) if e["kind"] == "quantized")

    def edit(fn):
        hh = json.loads(json.dumps(h))
        fn(hh)
        return _with_header(arrays, hh)

    bad = {
        "empty list": [],
        "not a list": arrays[0],
        "garbage header": [np.frombuffer(b"\xff\xfe{not json", np.uint8)] + arrays[1:],
        "header not uint8": [arrays[0].astype(np.int32)] + arrays[1:],
        "json array": [np.frombuffer(b"[1, 2]", np.uint8)] + arrays[1:],
        "wrong format": edit(lambda x: x.update(format="pickle")),
        "future version": edit(lambda x: x.update(format_version=99)),
        "bad params version": edit(lambda x: x.update(version="4")),
        "missing array": arrays[:-1],
        "extra array": arrays + [np.zeros(3, np.uint8)],
        "unknown kind": edit(lambda x: x["leaves"][qi].update(kind="mystery")),
        "bits out of range": edit(lambda x: x["leaves"][qi].update(bits=12)),
        "bad granularity": edit(lambda x: x["leaves"][qi].update(granularity="per_row")),
        "shape mismatch with data": edit(lambda x: x["leaves"][qi].update(
            shape=[d + 1 for d in x["leaves"][qi]["shape"]])),
        "negative dim": edit(lambda x: x["leaves"][qi].update(shape=[-1, 3])),
        "array index out of range": edit(lambda x: x["leaves"][qi].update(arrays=[0, 999])),
        "duplicate path": edit(lambda x: x["leaves"].append(dict(x["leaves"][qi]))),
        "array used twice": edit(lambda x: x["leaves"][qi].update(
            arrays=[x["leaves"][qi]["arrays"][0]] * 2)),
        "bad path": edit(lambda x: x["leaves"][qi].update(path=[1.5])),
    }
    for name, payload in bad.items():
        with pytest.raises(ValueError) as e:
            from_wire(payload)
        assert str(e.value), name
    # truncated / retyped data arrays name the leaf
    i = h["leaves"][qi]["arrays"][0]
    cut = list(arrays)
    cut[i] = cut[i][:-1]
    path = "/".join(h["leaves"][qi]["path"])
    with pytest.raises(ValueError, match=path):
        from_wire(cut)
    retyped = list(arrays)
    retyped[i] = retyped[i].view(np.int8)
    with pytest.raises(ValueError, match=path):
        from_wire(retyped)
    with pytest.raises(ValueError, match="version"):
        to_wire(quantize(net, QuantConfig()), version="latest")


def test_like_gives_the_payload_the_networks_structure():
    net = {"layers": (kernel((16, 8)), kernel((8, 4), seed=1)), "bias": np.zeros(4, np.float32)}
    q = quantize(net, QuantConfig(bits=4, min_size=0))
    back, _ = from_wire(to_wire(q), like=net)
    assert isinstance(back["layers"], tuple)  # without like, tuples come back as lists
    assert_bit_exact(back, q)
    assert isinstance(from_wire(to_wire(q))[0]["layers"], list)


def test_meta_travels_in_the_header():
    arrays = to_wire(quantize(small_net(), QuantConfig(bits=8)), version=3, meta={"max_priority": 7.5})
    assert wire_meta(arrays) == {"max_priority": 7.5}
    assert wire_meta(to_wire(quantize(small_net(), QuantConfig(bits=8)))) == {}
    with pytest.raises(ValueError, match="max_priority"):
        to_wire(quantize(small_net(), QuantConfig(bits=8)), meta={"max_priority": float("nan")})


@pytest.mark.parametrize("cfg", [QuantConfig(bits=8, min_size=0), QuantConfig(bits=4, symmetric=False, min_size=0),
                                 QuantConfig(bits=32), QuantConfig(bits=16, half="fp16")],
                         ids=["b8", "b4-asym", "f32", "fp16"])
def test_non_finite_payloads_are_malformed(cfg):
    arrays = to_wire(quantize(small_net(), cfg))
    header = _header(arrays)
    for entry in header["leaves"]:
        # The scale (quantized) or the data (float) of each leaf in turn.
        index = entry["arrays"][1 if entry["kind"] == "quantized" else 0]
        for bad in (np.inf, np.nan, 3e38):
            broken = [np.array(a, copy=True) for a in arrays]
            if entry["kind"] == "half":
                broken[index][0] = np.float16(bad if bad != 3e38 else np.inf).view(np.uint16)
            else:
                broken[index][0] = bad
            if bad == 3e38 and entry["kind"] != "quantized":
                continue  # a large but finite float weight is a valid weight
            with pytest.raises(ValueError, match="/".join(map(str, entry["path"]))):
                from_wire(broken)


def test_random_byte_flips_give_value_error_or_finite_weights():
    rng = np.random.default_rng(2026)
    payloads = [to_wire(quantize(small_net(), cfg)) for cfg in (
        QuantConfig(bits=8, min_size=0), QuantConfig(bits=4, min_size=0), QuantConfig(bits=3, symmetric=False, min_size=0),
        QuantConfig(bits=32), QuantConfig(bits=16, half="bf16"))]
    outcomes = {"rejected": 0, "accepted": 0}
    for trial in range(800):
        arrays = [np.array(a, copy=True) for a in payloads[trial % len(payloads)]]
        for _ in range(int(rng.integers(1, 4))):
            target = arrays[int(rng.integers(len(arrays)))]
            raw = target.view(np.uint8)
            raw[int(rng.integers(raw.size))] ^= np.uint8(1 << int(rng.integers(8)))
        try:
            qparams, _ = from_wire(arrays)
        except ValueError:
            outcomes["rejected"] += 1
            continue
        outcomes["accepted"] += 1
        for leaf in jax.tree_util.tree_leaves(dequantize(qparams)):
            leaf = np.asarray(leaf)
            if np.issubdtype(leaf.dtype, np.floating):
                assert np.all(np.isfinite(leaf)), f"trial {trial}: accepted a payload that dequantizes to NaN/inf"
    assert outcomes["rejected"] > 0 and outcomes["accepted"] > 0, outcomes


# ----------------------------------------------------------------------------- benchmark smoke

@pytest.mark.process
@pytest.mark.timeout(200)
def test_benchmark_quick_runs(tmp_path):
    out = tmp_path / "quantize.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "quantize.py"), "--quick", "--hidden", "256",
         "--repeats", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "quantize"
    assert {r["bits"] for r in result["rows"]} == {32, 16, 8, 4}
    assert set(result["headline"]) == {"wire_bytes_ratio_8bit", "wire_bytes_ratio_4bit"}
    assert 0 < result["headline"]["wire_bytes_ratio_4bit"] < result["headline"]["wire_bytes_ratio_8bit"] < 1
