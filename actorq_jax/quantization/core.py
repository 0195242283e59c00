"""Quantize / dequantize / fake-quant of parameter pytrees (jitted, pure).

A quantized parameter tree (``QuantizedParams``) has the same nested structure as
the float parameters it came from. Under ``QuantConfig.bits`` in 2..8 each
quantized leaf (see the rule in ``QuantConfig``) becomes a ``QuantizedTensor``:
int8 ``values`` of the kernel's shape plus float32 ``scale`` (and an int32
``zero_point`` when asymmetric). Under bits == 16 quantized leaves become plain
float16/bfloat16 arrays; under bits == 32 the tree is returned as float32.
Leaves that the rule does not select stay float32.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from actorq_jax.quantization.config import QuantConfig

# Scales below the smallest normal float32 are replaced by 1.0 so that a
# flushed-to-zero denormal can never be a divisor (all-zero or near-zero
# channels then quantize to 0, which is within half a step of the data).
_MIN_SCALE = float(np.finfo(np.float32).tiny)


def qrange(bits: int, symmetric: bool) -> tuple:
    """(qmin, qmax) of the integer grid for ``bits`` (symmetric drops -2^(b-1))."""
    qmax = 2 ** (bits - 1) - 1
    return (-qmax if symmetric else -(2 ** (bits - 1))), qmax


@struct.dataclass
class QuantizedTensor:
    """One integer-quantized kernel (a pytree node; ``bits`` is static).

    values: int8, the kernel's shape; every value lies in ``qrange(bits, symmetric)``.
    scale: float32; shape ``(N,)`` over the LAST axis (output channels) when
      per-channel, ``()`` when per-tensor.
    zero_point: int32 of ``scale``'s shape when asymmetric, None when symmetric.
    bits: 2..8.

    w ~= (values - zero_point) * scale, broadcast over the last axis.
    Construct with keywords: ``QuantizedTensor(values=..., scale=..., zero_point=..., bits=...)``.
    """

    values: Any
    scale: Any
    zero_point: Any = None
    bits: int = struct.field(pytree_node=False, default=8)

    @property
    def symmetric(self) -> bool:
        return self.zero_point is None

    @property
    def granularity(self) -> str:
        return "per_tensor" if np.ndim(self.scale) == 0 else "per_channel"

    @property
    def shape(self) -> tuple:
        return tuple(np.shape(self.values))


# A pytree with the nested structure of the float params whose leaves are arrays
# (float32, or float16/bfloat16 under bits == 16) or QuantizedTensor nodes.
QuantizedParams = Union[Mapping[str, Any], QuantizedTensor, jax.Array]


def is_quantized_leaf(x) -> bool:
    """True for a QuantizedTensor (use as ``is_leaf`` when mapping over QuantizedParams)."""
    return isinstance(x, QuantizedTensor)


def _is_floating(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def selected(x, config: QuantConfig) -> bool:
    """The rule: floating, ndim >= 2 and size >= max(min_size, 1) (static, from shape/dtype)."""
    return _is_floating(x) and np.ndim(x) >= 2 and int(np.size(x)) >= max(config.min_size, 1)


def _half_dtype(config: QuantConfig):
    return jnp.bfloat16 if config.half == "bf16" else jnp.float16


def _channel_reduce(x: jnp.ndarray, op, per_channel: bool) -> jnp.ndarray:
    """op-reduce (jnp.maximum / jnp.minimum) over all axes but the last -> (N,), or to () per-tensor.

    Written as a halving tree of elementwise ops: XLA:CPU's reduce_max over a
    leading axis runs ~25x slower than this on a 2048x2048 kernel. The halves
    overlap by one row when the length is odd, harmless for an idempotent op.
    """
    x = x.reshape(-1, x.shape[-1])
    while x.shape[0] > 1:
        k = x.shape[0]
        c = (k + 1) // 2
        x = op(x[:c], x[k - c:])
    x = x[0]
    if per_channel:
        return x
    return jnp.max(x) if op is jnp.maximum else jnp.min(x)


def _quantize_tensor(w: jnp.ndarray, config: QuantConfig) -> QuantizedTensor:
    """Integer-quantize one float32 kernel (traceable).

    Scales multiply by the float32 reciprocal of the grid size (XLA rewrites a
    division by a constant into exactly that, so it is spelled out to keep every
    backend and the numpy reference in the tests bit-identical); w / scale is a
    true division.
    """
    bits = config.bits
    qmin, qmax = qrange(bits, config.symmetric)
    per_channel = config.granularity == "per_channel"
    if config.symmetric:
        amax = _channel_reduce(jnp.abs(w), jnp.maximum, per_channel)
        scale = amax * jnp.float32(1.0 / qmax)
        scale = jnp.where(scale >= _MIN_SCALE, scale, jnp.float32(1.0)).astype(jnp.float32)
        q = jnp.clip(jnp.round(w / scale), qmin, qmax).astype(jnp.int8)
        return QuantizedTensor(values=q, scale=scale, zero_point=None, bits=bits)
    lo = jnp.minimum(_channel_reduce(w, jnp.minimum, per_channel), 0.0)
    hi = jnp.maximum(_channel_reduce(w, jnp.maximum, per_channel), 0.0)
    scale = (hi - lo) * jnp.float32(1.0 / (qmax - qmin))
    scale = jnp.where(scale >= _MIN_SCALE, scale, jnp.float32(1.0)).astype(jnp.float32)
    zp = jnp.clip(qmin - jnp.round(lo / scale), qmin, qmax)
    q = jnp.clip(jnp.round(w / scale) + zp, qmin, qmax).astype(jnp.int8)
    return QuantizedTensor(values=q, scale=scale, zero_point=zp.astype(jnp.int32), bits=bits)


def _dequantize_tensor(qt: QuantizedTensor) -> jnp.ndarray:
    values = jnp.asarray(qt.values)
    scale = jnp.asarray(qt.scale, jnp.float32)
    if qt.zero_point is None:
        return values.astype(jnp.float32) * scale
    centred = values.astype(jnp.int32) - jnp.asarray(qt.zero_point, jnp.int32)
    return centred.astype(jnp.float32) * scale


def _quantize_leaf(x, config: QuantConfig):
    if not _is_floating(x):
        return x
    x = jnp.asarray(x, jnp.float32)
    if config.is_float or not selected(x, config):
        return x
    if config.is_half:
        return x.astype(_half_dtype(config))
    return _quantize_tensor(x, config)


def _dequantize_leaf(x):
    if is_quantized_leaf(x):
        return _dequantize_tensor(x)
    if _is_floating(x):
        return jnp.asarray(x, jnp.float32)
    return x


def _quantize_tree(params, config: QuantConfig):
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    return jax.tree_util.tree_map(lambda x: _quantize_leaf(x, config), params)


_quantize_jit = jax.jit(_quantize_tree, static_argnums=1)
_dequantize_leaves_jit = jax.jit(lambda leaves: [_dequantize_leaf(x) for x in leaves])
_dequantize_tensor_jit = jax.jit(_dequantize_tensor)


def _is_f32_jax_array(x) -> bool:
    return isinstance(x, jax.Array) and x.dtype == jnp.float32


def _as_f32(x):
    if not _is_floating(x) or _is_f32_jax_array(x):
        return x
    return jnp.asarray(x, jnp.float32)


def quantize(params, config: QuantConfig = QuantConfig()) -> QuantizedParams:
    """Quantize a float parameter pytree (jitted; ``config`` is static).

    Returns a tree of the same structure: QuantizedTensor for leaves selected by
    the rule (bits 2..8), half arrays for them under bits == 16, float32 for
    everything else. Under bits == 32 every floating leaf is float32 (float32
    jax arrays are returned as they are, without a copy).
    """
    if isinstance(config, QuantConfig) and config.is_float:
        return jax.tree_util.tree_map(_as_f32, params)
    return _quantize_jit(params, config)


def quantized_shapes(params: Any, config: QuantConfig = QuantConfig()) -> QuantizedParams:
    """What ``quantize(params, config)`` returns, as jax.ShapeDtypeStruct leaves: computes nothing.

    ``params`` may itself hold ShapeDtypeStruct leaves (a network's ``jax.eval_shape``'d init); the result is
    what ``from_wire`` needs as ``like`` to check a payload's structure and shapes.
    """
    return jax.eval_shape(lambda p: quantize(p, config), params)


def dequantize(qparams: QuantizedParams):
    """Float32 tree of the original structure (QuantizedTensor and half leaves -> float32).

    The conversions run in one jitted call; leaves that are already float32 jax
    arrays (and non-floating leaves) are returned as they are.
    """
    leaves, treedef = jax.tree_util.tree_flatten(qparams, is_leaf=is_quantized_leaf)
    work = [i for i, x in enumerate(leaves)
            if is_quantized_leaf(x) or (_is_floating(x) and not _is_f32_jax_array(x))]
    if work:
        done = _dequantize_leaves_jit([leaves[i] for i in work])
        leaves = list(leaves)
        for i, x in zip(work, done):
            leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def dequantize_tensor(qt: QuantizedTensor) -> jnp.ndarray:
    """float32 ``(values - zero_point) * scale`` of one QuantizedTensor (jitted)."""
    if not is_quantized_leaf(qt):
        raise TypeError(f"dequantize_tensor expects a QuantizedTensor, got {type(qt).__name__}")
    return _dequantize_tensor_jit(qt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fake_quant_leaf(x, config: QuantConfig):
    return _dequantize_leaf(_quantize_leaf(x, config))


def _fake_quant_leaf_fwd(x, config):
    return _fake_quant_leaf(x, config), None


def _fake_quant_leaf_bwd(config, _, g):
    # Straight-through estimator: d fake_quant(x) / dx = identity.
    return (g,)


_fake_quant_leaf.defvjp(_fake_quant_leaf_fwd, _fake_quant_leaf_bwd)


def _fake_quant_tree(params, config: QuantConfig):
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")

    def leaf(x):
        if not _is_floating(x):
            return x
        return _fake_quant_leaf(jnp.asarray(x, jnp.float32), config)

    return jax.tree_util.tree_map(leaf, params)


_fake_quant_jit = jax.jit(_fake_quant_tree, static_argnums=1)


def fake_quant(params, config: QuantConfig = QuantConfig()):
    """``dequantize(quantize(params, config))`` as float32, jitted and differentiable.

    The gradient is the straight-through estimator: d fake_quant / d params is the
    identity (quantization-aware training can use it directly).
    """
    return _fake_quant_jit(params, config)
