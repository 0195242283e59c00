"""Int8 dense layers: packed weights, the FFI call, and the pure-jnp reference of the same math.

    y = x @ (Wq * scale) + bias          (W8A32: float activations)
    y = (q(x) @ Wq) * (sx * scale) + bias (W8A8: x quantized per row to +-127)
    the same with 4-bit weights, -8..7   (W4A8: two weights per byte)

``pack_dense`` repacks int8 weights once, at load time, into the kernel's
panel layout; ``int8_dense`` runs inside ``jax.jit`` and falls back to
``reference_int8_dense`` (warning once, naming why) when the library is missing.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from actorq_jax import activations
from actorq_jax.kernels import _library

PANEL = 16  # output columns per weight panel
MODES = ("w8a32", "w8a8", "w4a8")
PATHS = ("auto", "scalar", "avx2", "avx512", "amx", "reference")
# Activations the kernel fuses into its epilogue, and the jnp function each one matches.
# elu: jax.nn.elu's values and derivatives in the form XLA:CPU fuses into a matmul (actorq_jax.activations).
ACTIVATIONS = {"relu": jax.nn.relu, "elu": activations.elu, "tanh": jnp.tanh}
_ACTIVATION_CODES = {None: 0, "relu": 1, "elu": 2, "tanh": 3}
_DENSE_TARGETS = {"w8a32": _library.TARGET_W8A32, "w8a8": _library.TARGET_W8A8, "w4a8": _library.TARGET_W4A8}
# The fused MLP call's op codes (enum Op in int8_dense.cc).
_OP_CODES = {"w8a32": 0, "w8a8": 1, "w4a8": 2, "layer_norm": 3}


@struct.dataclass
class Int8DenseWeight:
    """Int8 dense-layer weights packed for the kernel (a pytree node; sizes and mode are static).

    packed: int8 of shape ``[K, N]`` (exactly the bytes of the original kernel,
      so flax's parameter shape check passes) holding the kernel's panel layout:
      16-column panels one after another, panel p starting at byte 16 * p * K;
      inside a panel of width w, w8a32 stores ``[K, w]`` and w8a8 stores
      ``[K // 4, w, 4]`` followed by ``[K % 4, w]``. w4a8 instead has shape
      ``[K8 // 2, 16 * panels]`` (K8: K rounded up to 8; the layout is described
      in int8_dense.cc above W4A8Scalar).
    scale: float32 ``(N,)``, per output channel.
    colsum: int32 ``(16 * ceil(N / 16),)``, column sums of the int8 weights
      (zero-padded; the AVX-512 VNNI W8A8 path needs them).
    """

    packed: Any
    scale: Any
    colsum: Any
    in_features: int = struct.field(pytree_node=False)
    out_features: int = struct.field(pytree_node=False)
    mode: str = struct.field(pytree_node=False, default="w8a32")

    @property
    def panels(self) -> int:
        """Number of 16-column panels."""
        return -(-self.out_features // PANEL)

    def unpack(self) -> jnp.ndarray:
        """The int8 weights as ``[K, N]`` in plain row-major order (traceable)."""
        if self.mode == "w4a8":
            return _from_nibbles(jnp, jnp.asarray(self.packed), self.in_features, self.out_features)
        return _from_panels(jnp, jnp.asarray(self.packed).reshape(-1), self.in_features,
                            self.out_features, self.mode)

    @property
    def packed_shape(self) -> tuple:
        """Shape ``packed`` must have for this mode and size."""
        if self.mode == "w4a8":
            return (_round8(self.in_features) // 2, self.panels * PANEL)
        return (self.in_features, self.out_features)


def _panel_blocks(N: int) -> list:
    """(first column, width, count) of the full panels and of the narrow last panel."""
    full, tail = divmod(N, PANEL)
    blocks = [(0, PANEL, full)] if full else []
    if tail:
        blocks.append((full * PANEL, tail, 1))
    return blocks


def _from_panels(xp: Any, flat: Any, K: int, N: int, mode: str) -> Any:
    """Panel layout (flat, K * N bytes) -> [K, N]; ``xp`` is numpy or jax.numpy."""
    G, rem = divmod(K, 4)
    cols = []
    for n0, width, count in _panel_blocks(N):
        block = flat[n0 * K:(n0 + width * count) * K].reshape(count, K * width)
        if mode == "w8a32":
            panel = block.reshape(count, K, width)
        else:
            grouped = block[:, :G * 4 * width].reshape(count, G, width, 4).transpose(0, 1, 3, 2)
            rest = block[:, G * 4 * width:].reshape(count, rem, width)
            panel = xp.concatenate([grouped.reshape(count, G * 4, width), rest], axis=1)
        cols.append(panel.transpose(1, 0, 2).reshape(K, count * width))
    return xp.concatenate(cols, axis=1) if len(cols) > 1 else cols[0]


def _round8(K: int) -> int:
    return -(-K // 8) * 8


def _to_nibbles(values: np.ndarray) -> np.ndarray:
    """int8 [K, N] in -8..7 -> the W4A8 layout, int8 ``[K8 // 2, 16 * panels]``."""
    K, N = values.shape
    K8, P = _round8(K), -(-N // PANEL)
    padded = np.zeros((K8, P * PANEL), np.uint8)
    padded[:K, :N] = values.astype(np.int16) + 8
    padded[K:, :] = 8
    padded[:, N:] = 8
    # k = 8b + 4h + j, column = 16p + c  ->  [p, b, c, j], low nibble h = 0, high nibble h = 1.
    u = padded.reshape(K8 // 8, 2, 4, P, PANEL).transpose(1, 3, 0, 4, 2)
    packed = u[0] | (u[1] << 4)
    return np.ascontiguousarray(packed).reshape(K8 // 2, P * PANEL).view(np.int8)


def _from_nibbles(xp: Any, packed: Any, K: int, N: int) -> Any:
    """The W4A8 layout -> int8 [K, N]; ``xp`` is numpy or jax.numpy."""
    K8, P = _round8(K), -(-N // PANEL)
    b = packed.reshape(P, K8 // 8, PANEL, 4).astype(xp.int16) & 0xFF
    lo, hi = b & 15, b >> 4
    u = xp.stack([lo, hi])  # [h, p, b, c, j]
    vals = u.transpose(2, 0, 4, 1, 3).reshape(K8, P * PANEL) - 8
    return vals[:K, :N].astype(xp.int8)


def _to_panels(values: np.ndarray, mode: str) -> np.ndarray:
    """[K, N] -> the panel layout as a flat array of K * N bytes (inverse of _from_panels)."""
    K, N = values.shape
    G, rem = divmod(K, 4)
    parts = []
    for n0, width, count in _panel_blocks(N):
        panel = values[:, n0:n0 + width * count].reshape(K, count, width).transpose(1, 0, 2)
        if mode == "w8a32":
            parts.append(panel.reshape(-1))
        else:
            grouped = panel[:, :G * 4].reshape(count, G, 4, width).transpose(0, 1, 3, 2)
            rest = panel[:, G * 4:]
            parts.append(np.concatenate([grouped.reshape(count, -1), rest.reshape(count, -1)], axis=1).reshape(-1))
    return np.ascontiguousarray(np.concatenate(parts))


def _column_sums(values: np.ndarray) -> np.ndarray:
    """Column sums of int8 [K, N], zero-padded to whole panels (int32)."""
    N = values.shape[1]
    colsum = np.zeros(-(-N // PANEL) * PANEL, np.int32)
    colsum[:N] = values.astype(np.int32).sum(axis=0)
    return colsum


def _pack_panels(values: np.ndarray, mode: str) -> tuple:
    """(flat panel layout, column sums) of int8 [K, N]: one C pass when the library is built, else numpy."""
    lib = _library.state().lib
    if lib is None:
        return (_to_nibbles(values) if mode == "w4a8" else _to_panels(values, mode)), _column_sums(values)
    K, N = values.shape
    values = np.ascontiguousarray(values)
    P = -(-N // PANEL)
    packed = np.empty(_round8(K) * 8 * P if mode == "w4a8" else K * N, np.int8)
    colsum = np.empty(P * PANEL, np.int32)
    lib.actorq_pack_panels(values.ctypes.data, K, N, MODES.index(mode), packed.ctypes.data, colsum.ctypes.data)
    return packed, colsum


def pack_dense(values: Any, scale: Any, mode: str = "w8a32") -> Int8DenseWeight:
    """Repacks int8 weights ``[K, N]`` and their scale ((N,) or ()) into an Int8DenseWeight."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    values = np.asarray(values)
    if values.dtype != np.int8:
        raise ValueError(f"values must be int8, got dtype {values.dtype}")
    if values.ndim != 2 or 0 in values.shape:
        raise ValueError(f"values must be a non-empty 2-D [K, N] array, got shape {values.shape}")
    K, N = values.shape
    scale = np.asarray(scale)
    if not np.issubdtype(scale.dtype, np.floating):
        raise ValueError(f"scale must be floating, got dtype {scale.dtype}")
    if scale.shape not in ((), (N,)):
        raise ValueError(f"scale must have shape () or ({N},), got {scale.shape}")
    scale = np.broadcast_to(scale.astype(np.float32), (N,)).copy()
    if mode == "w4a8" and (values.min() < -8 or values.max() > 7):
        raise ValueError(f"w4a8 needs 4-bit values in [-8, 7], got [{values.min()}, {values.max()}]")
    packed, colsum = _pack_panels(values, mode)
    shape = (_round8(K) // 2, -(-N // PANEL) * PANEL) if mode == "w4a8" else (K, N)
    return Int8DenseWeight(
        packed=jnp.asarray(packed.reshape(shape)),
        scale=jnp.asarray(scale),
        colsum=jnp.asarray(colsum),
        in_features=int(K),
        out_features=int(N),
        mode=mode,
    )


def quantize_rows(x: jnp.ndarray) -> tuple:
    """W8A8 activation quantization per row: (int8 q, float32 row scale sx), x ~= q * sx."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    inv = jnp.where(amax > 0, jnp.float32(127.0) / jnp.where(amax > 0, amax, 1.0), 0.0)
    q = jnp.clip(jnp.round(x * inv), -127, 127).astype(jnp.int8)
    return q, amax / jnp.float32(127.0)


def reference_int8_dense(
    x: jnp.ndarray, w: Int8DenseWeight, bias: Optional[jnp.ndarray] = None, activation: Optional[str] = None
) -> jnp.ndarray:
    """The kernel's math in pure jnp (float32 [..., K] -> float32 [..., N])."""
    x, bias = _check(x, w, bias)
    _check_activation(activation)
    wq = w.unpack()
    scale = jnp.asarray(w.scale, jnp.float32)
    if w.mode == "w8a32":
        y = jnp.dot(x, wq.astype(jnp.float32) * scale)
    else:
        q, sx = quantize_rows(x)
        acc = jax.lax.dot_general(
            q, wq, (((q.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32
        )
        y = acc.astype(jnp.float32) * (sx * scale)
    y = y + bias
    return y if activation is None else ACTIVATIONS[activation](y)


def _check_activation(activation: Optional[str]) -> None:
    if activation not in _ACTIVATION_CODES:
        raise ValueError(f"activation must be None or one of {sorted(ACTIVATIONS)}, got {activation!r}")


def _activation_code(activation: Optional[str]) -> int:
    _check_activation(activation)
    return _ACTIVATION_CODES[activation]


_warned_fallback = False


def _warn_fallback_once(reason: str) -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"actorq int8 kernel unavailable ({reason}); using the pure-jnp reference "
            "(same results, much slower)",
            RuntimeWarning,
            stacklevel=3,
        )


def _default_path() -> str:
    path = os.environ.get(_library.ENV_PATH, "auto").strip().lower() or "auto"
    if path not in PATHS:
        raise ValueError(f"${_library.ENV_PATH} must be one of {PATHS}, got {path!r}")
    return path


def _kernel_path(path: Optional[str]) -> Optional[int]:
    """The kernel's code for ``path`` (None: $ACTORQ_KERNEL_PATH or auto), or None where the jnp reference runs."""
    path = _default_path() if path is None else path
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path == "reference":
        return None
    state = _library.state()
    if state.lib is None:
        if path != "auto":
            # A named path is a request for the compiled kernel; answering it with the slow
            # reference would hide a broken build behind a benchmark figure.
            raise ValueError(f"kernel path {path!r} needs the int8 library, which is unavailable: {state.reason}")
        _warn_fallback_once(state.reason)
        return None
    if not _library.path_supported(path):
        raise ValueError(f"kernel path {path!r} is not supported by this CPU (best: {_library.best_path()})")
    return _library.PATH_CODES[path]


def _call_kernel(target: str, x: jnp.ndarray, width: int, operands: list, **attrs: Any) -> jnp.ndarray:
    """One FFI call of ``target`` on x [..., K] (leading axes flattened) -> float32 [..., width]."""
    from jax.extend import ffi as jffi

    lead = tuple(x.shape[:-1])
    M = math.prod(lead)
    if M == 0:
        return jnp.zeros(lead + (width,), jnp.float32)
    y = jffi.ffi_call(target, jax.ShapeDtypeStruct((M, width), jnp.float32), x.reshape(M, x.shape[-1]),
                      *operands, **attrs)
    return y.reshape(lead + (width,))


def _check(x: Any, w: Any, bias: Any) -> tuple:
    """Validates int8_dense's inputs; returns (x, bias) with bias materialised as float32 (N,)."""
    bias = _check_weight(w, bias)
    return _check_x(x, w.in_features, "in_features"), bias


def _check_x(x: Any, K: int, what: str) -> jnp.ndarray:
    """x as a float32 jnp array of shape [..., K]; a ValueError naming the bad dtype or shape otherwise."""
    x_dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype  # before jnp silently casts float64
    if x_dtype != jnp.float32:
        raise ValueError(f"x must be float32, got dtype {x_dtype}")
    x = jnp.asarray(x)
    if x.ndim < 1 or x.shape[-1] != K:
        raise ValueError(f"x must have shape [..., {K}] ({what}), got {tuple(x.shape)}")
    return x


def _check_weight(w: Any, bias: Any) -> jnp.ndarray:
    """Validates packed weights and their bias; returns the bias materialised as float32 (N,)."""
    if not isinstance(w, Int8DenseWeight):
        raise ValueError(f"w must be an Int8DenseWeight (see pack_dense), got {type(w).__name__}")
    if w.mode not in MODES:
        raise ValueError(f"Int8DenseWeight.mode must be one of {MODES}, got {w.mode!r}")
    N = w.out_features
    packed = w.packed
    if jnp.result_type(packed) != jnp.int8 or tuple(np.shape(packed)) != w.packed_shape:
        raise ValueError(
            f"packed weights must be int8 of shape {w.packed_shape}, got {jnp.result_type(packed)} {tuple(np.shape(packed))}"
        )
    _check_vector("scale", w.scale, N)
    if tuple(np.shape(w.colsum)) != (w.panels * PANEL,) or jnp.result_type(w.colsum) != jnp.int32:
        raise ValueError(f"colsum must be int32 of shape ({w.panels * PANEL},), got {np.shape(w.colsum)}")
    if bias is None:
        return jnp.zeros((N,), jnp.float32)
    _check_vector("bias", bias, N)
    return jnp.asarray(bias)


def _check_vector(name: str, v: Any, N: int) -> None:
    dtype = v.dtype if hasattr(v, "dtype") else np.asarray(v).dtype
    if dtype != jnp.float32 or tuple(np.shape(v)) != (N,):
        raise ValueError(f"{name} must be float32 of shape ({N},), got {dtype} {tuple(np.shape(v))}")


def int8_dense(
    x: jnp.ndarray,
    w: Int8DenseWeight,
    bias: Optional[jnp.ndarray] = None,
    *,
    path: Optional[str] = None,
    activation: Optional[str] = None,
) -> jnp.ndarray:
    """Int8 dense layer ``act(x @ (Wq * scale) + bias)`` through the CPU kernel (jit-compatible).

    ``path`` forces an instruction-set path ("scalar", "avx2", "avx512") or the
    jnp "reference"; default $ACTORQ_KERNEL_PATH or "auto" (the fastest this CPU has).
    ``activation`` ("relu", "elu", "tanh" or None) is fused into the kernel's epilogue.
    """
    x, bias = _check(x, w, bias)
    _check_activation(activation)
    kernel_path = _kernel_path(path)
    if kernel_path is None:
        return reference_int8_dense(x, w, bias, activation)
    return _call_kernel(_DENSE_TARGETS[w.mode], x, w.out_features, [w.packed, w.scale, bias, w.colsum],
                        out_features=int(w.out_features), path=kernel_path,
                        activation=_ACTIVATION_CODES[activation])


def reference_layer_norm(
    x: jnp.ndarray, scale: jnp.ndarray, bias: jnp.ndarray, epsilon: float = 1e-6, activation: Optional[str] = None
) -> jnp.ndarray:
    """flax.linen.LayerNorm's math over the last axis (fast variance), then the activation."""
    _check_activation(activation)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(jnp.square(x), axis=-1, keepdims=True) - jnp.square(mean))
    y = (x - mean) * (scale * jax.lax.rsqrt(var + epsilon)) + bias
    return y if activation is None else ACTIVATIONS[activation](y)


def _check_layer_norm(scale: Any, bias: Any, epsilon: float, N: int) -> None:
    _check_vector("scale", scale, N)
    _check_vector("bias", bias, N)
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")


def layer_norm(
    x: jnp.ndarray,
    scale: jnp.ndarray,
    bias: jnp.ndarray,
    *,
    epsilon: float = 1e-6,
    activation: Optional[str] = None,
    path: Optional[str] = None,
) -> jnp.ndarray:
    """``act(LayerNorm(x) * scale + bias)`` over the last axis as one CPU kernel call (jit-compatible)."""
    _check_activation(activation)
    x_dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype  # before jnp silently casts float64
    if x_dtype != jnp.float32 or np.ndim(x) < 1 or np.shape(x)[-1] < 1:
        raise ValueError(f"x must be float32 of shape [..., N >= 1], got {x_dtype} {tuple(np.shape(x))}")
    x = jnp.asarray(x)
    N = x.shape[-1]
    _check_layer_norm(scale, bias, epsilon, N)
    kernel_path = _kernel_path(path)
    if kernel_path is None:
        return reference_layer_norm(x, scale, bias, epsilon, activation)
    return _call_kernel(_library.TARGET_LAYER_NORM, x, N, [jnp.asarray(scale), jnp.asarray(bias)],
                        epsilon=np.float32(epsilon), activation=_ACTIVATION_CODES[activation], path=kernel_path)


@struct.dataclass
class MlpDense:
    """One dense layer of an int8_mlp: act(x @ weight + bias) (a pytree node; the activation is static)."""

    weight: Int8DenseWeight
    bias: Optional[jnp.ndarray] = None
    activation: Optional[str] = struct.field(pytree_node=False, default=None)


@struct.dataclass
class MlpLayerNorm:
    """One layer norm of an int8_mlp: act(LayerNorm(x) * scale + bias) (epsilon and activation are static)."""

    scale: jnp.ndarray
    bias: jnp.ndarray
    epsilon: float = struct.field(pytree_node=False, default=1e-6)
    activation: Optional[str] = struct.field(pytree_node=False, default=None)


def int8_mlp(x: jnp.ndarray, layers: Sequence[Any], *, path: Optional[str] = None) -> jnp.ndarray:
    """A stack of MlpDense and MlpLayerNorm layers as one CPU kernel call (jit-compatible).

    Equal bit for bit to calling int8_dense and layer_norm layer by layer on the
    same path; falls back to those calls' jnp reference as they do.
    """
    if not layers:
        raise ValueError("int8_mlp needs at least one layer, got none")
    operands, program, epsilons = [], [], []
    width = None
    for i, layer in enumerate(layers):
        if isinstance(layer, MlpDense):
            bias = _check_weight(layer.weight, layer.bias)
            if width is not None and layer.weight.in_features != width:
                raise ValueError(f"layer {i} takes {layer.weight.in_features} inputs, the layer before gives {width}")
            operands += [layer.weight.packed, layer.weight.scale, bias, layer.weight.colsum]
            program += [_OP_CODES[layer.weight.mode], layer.weight.out_features, _activation_code(layer.activation)]
            width = layer.weight.out_features
        elif isinstance(layer, MlpLayerNorm):
            if width is None:
                width = int(np.shape(layer.scale)[0]) if np.ndim(layer.scale) == 1 else -1
            _check_layer_norm(layer.scale, layer.bias, layer.epsilon, width)
            operands += [jnp.asarray(layer.scale), jnp.asarray(layer.bias)]
            program += [_OP_CODES["layer_norm"], width, _activation_code(layer.activation)]
            epsilons.append(layer.epsilon)
        else:
            raise ValueError(f"layer {i} must be an MlpDense or MlpLayerNorm, got {type(layer).__name__}")
    first = layers[0]
    x = _check_x(x, first.weight.in_features if isinstance(first, MlpDense) else int(np.shape(first.scale)[0]),
                 "the first layer's inputs")
    kernel_path = _kernel_path(path)
    if kernel_path is None:
        for layer in layers:
            if isinstance(layer, MlpDense):
                x = reference_int8_dense(x, layer.weight, layer.bias, layer.activation)
            else:
                x = reference_layer_norm(x, layer.scale, layer.bias, layer.epsilon, layer.activation)
        return x
    # One epsilon more than needed: an empty array attribute is not a valid dense array.
    return _call_kernel(_library.TARGET_MLP, x, width, operands, program=np.asarray(program, np.int64),
                        epsilons=np.asarray(epsilons + [0.0], np.float32), path=kernel_path)


def pack_params(qparams: Any, mode: str = "w8a32") -> Any:
    """Replaces symmetric 2-D QuantizedTensor leaves (bits <= 8) by Int8DenseWeight; asymmetric ones become float32.

    With ``mode="w4a8"`` leaves of at most 4 bits are packed two per byte and
    wider ones (5-8 bits) fall back to w8a8.
    """
    from actorq_jax import quantization

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    def convert(leaf: Any) -> Any:
        if not quantization.is_quantized_leaf(leaf):
            return leaf
        if leaf.zero_point is not None:
            return quantization.dequantize_tensor(leaf)
        if leaf.bits <= 8 and np.ndim(leaf.values) == 2:
            leaf_mode = "w8a8" if mode == "w4a8" and leaf.bits > 4 else mode
            return pack_dense(np.asarray(leaf.values), np.asarray(leaf.scale), leaf_mode)
        return leaf

    return jax.tree_util.tree_map(convert, qparams, is_leaf=quantization.is_quantized_leaf)
