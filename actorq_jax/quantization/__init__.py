"""Quantization core of ActorQ: a float32 learner publishes quantized parameters.

    from actorq_jax.quantization import QuantConfig, quantize, dequantize, to_wire, from_wire

    q = quantize(params, QuantConfig(bits=8))          # jitted; QuantizedTensor leaves
    arrays = to_wire(q, version=step)                    # list of numpy arrays for Reverb
    q2, step = from_wire(arrays, like=params)            # bit-exact; checks shapes
    actor_params = dequantize(q2)                        # float32 tree, original structure

Which leaves are quantized: floating leaves with ndim >= 2 (Dense/Conv kernels)
and size >= ``QuantConfig.min_size``; biases, LayerNorm parameters and small
kernels stay float32. See ``QuantConfig`` for the integer grids and
``actorq_jax.quantization.wire`` for the payload layout.
"""

from actorq_jax.quantization.config import QuantConfig
from actorq_jax.quantization.core import (
    QuantizedParams,
    QuantizedTensor,
    dequantize,
    dequantize_tensor,
    fake_quant,
    is_quantized_leaf,
    quantize,
    quantized_shapes,
)
from actorq_jax.quantization.wire import from_wire, to_wire, wire_nbytes

__all__ = [
    "QuantConfig",
    "QuantizedTensor",
    "QuantizedParams",
    "quantize",
    "quantized_shapes",
    "dequantize",
    "dequantize_tensor",
    "fake_quant",
    "to_wire",
    "from_wire",
    "is_quantized_leaf",
    "wire_nbytes",
]
