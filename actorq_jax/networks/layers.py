"""A Dense layer whose kernel may be float, fake-quantized or packed int8.

Quantization is injected into the same model (AQT style) rather than kept in a
second copy of each network: the layer looks at the kind of kernel it is given
at apply time and picks the matching matmul. The parameter tree of a float
network, of its `quantize(...)` output and of `kernels.pack_params(...)` all
apply through the same module.
"""

from typing import Any, Callable, Optional

import flax.linen as nn
import jax.numpy as jnp

from actorq_jax import kernels, quantization

# The activations a Dense layer can apply itself are the ones the int8 kernel fuses
# (importing kernels loads no library; that happens at the first kernel call).
ACTIVATIONS = kernels.ACTIVATIONS

Initializer = Callable[..., Any]


def activation_fn(name: str) -> Callable[[jnp.ndarray], jnp.ndarray]:
    """The activation function called `name`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


# XLA:CPU hands a 2-D dot to oneDNN from 2^24 FLOPs up, a batched one from 2^19. The dots between (the
# critic head's 256x256 -> 51 atoms at batch 256, forward and in its gradient) run in XLA's own loops at
# about 30 GFLOP/s; split into two batched halves, the same products run in oneDNN, 1.8x faster.
ONEDNN_2D_MIN_FLOPS, ONEDNN_BATCHED_MIN_FLOPS = 2**24, 2**19
SPLIT_MIN_DIM = 32  # a thin operand (K or N under this) gains nothing from the split
# An actor's few rows (K environments) against a wide layer run 2-4x slower split (2..16 x 512..1024);
# from 64 rows the split gained in the forward pass and in the gradient alike (1.2-1.9x).
SPLIT_MIN_ROWS = 64


def float_matmul(x: jnp.ndarray, kernel: jnp.ndarray) -> jnp.ndarray:
    """x @ kernel, as two batched halves where that moves the dot into XLA:CPU's oneDNN range."""
    if x.ndim != 2:
        return jnp.dot(x, kernel)
    (rows, inner), outer = x.shape, kernel.shape[1]
    flops = 2 * rows * inner * outer
    if (rows % 2 or rows < SPLIT_MIN_ROWS or min(inner, outer) < SPLIT_MIN_DIM
            or not ONEDNN_BATCHED_MIN_FLOPS <= flops < ONEDNN_2D_MIN_FLOPS):
        return jnp.dot(x, kernel)
    halves = x.reshape(2, rows // 2, inner)
    y = jnp.einsum("gmk,gkn->gmn", halves, jnp.broadcast_to(kernel, (2, inner, outer)))
    return y.reshape(rows, outer)


def apply_dense(x: jnp.ndarray, kernel: Any, bias: Optional[jnp.ndarray], activation: Optional[str] = None) -> jnp.ndarray:
    """Computes act(x @ kernel + bias) for a float, half, QuantizedTensor or Int8DenseWeight kernel."""
    if activation is not None:
        act = activation_fn(activation)
    if isinstance(kernel, jnp.ndarray) or hasattr(kernel, "__array__"):
        y = float_matmul(x, jnp.asarray(kernel).astype(x.dtype))
    else:
        if isinstance(kernel, kernels.Int8DenseWeight):
            # The kernel applies the activation in its epilogue: no separate XLA op per layer.
            return kernels.int8_dense(x, kernel, None if bias is None else bias.astype(x.dtype), activation=activation)
        if not isinstance(kernel, quantization.QuantizedTensor):
            raise TypeError(f"Dense kernel of unsupported type {type(kernel).__name__}")
        y = jnp.dot(x, quantization.dequantize_tensor(kernel).astype(x.dtype))
    y = y if bias is None else y + bias.astype(x.dtype)
    return y if activation is None else act(y)


class Dense(nn.Module):
    """Fully connected layer: y = x @ kernel + bias, with float, quantized or int8 kernels."""

    features: int
    use_bias: bool = True
    kernel_init: Initializer = nn.initializers.lecun_normal()
    activation: Optional[str] = None  # "relu", "elu" or "tanh", applied to the output

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        if self.has_variable("params", "kernel"):
            # Read directly: `self.param` would check the shape of a packed int8 kernel
            # against the float layout and reject it.
            kernel = self.get_variable("params", "kernel")
            bias = self.get_variable("params", "bias") if self.use_bias else None
        else:
            kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), jnp.float32)
            bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32) if self.use_bias else None
        return apply_dense(x, kernel, bias, self.activation)
