"""How an actor turns the parameters it receives into the parameters it runs.

The learner publishes at `comm_bits`; an actor runs at `actor_bits` through a
backend: `fp32` (float weights), `fakequant` (float math on b-bit weights) or
`int8` (the int8 kernel on packed weights). The same loader serves the
actors of every agent and the evaluator's quantized policy.
"""

import dataclasses
import logging
from typing import Any, Callable, Optional

import jax

from actorq_jax.quantization import QuantConfig, dequantize, quantize

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ActorPrecision:
    """Bits on the wire, bits in the actor, and the backend that runs them."""

    actor_bits: int = 32
    comm_bits: int = 32
    granularity: str = "per_channel"
    backend: str = "auto"
    int8_mode: str = "w8a8"  # activations of the int8 kernel: quantized per row (w8a8) or float (w8a32)

    def kernel_mode(self) -> str:
        """Packing of the int8 backend: w8a8 actors of at most 4 bits pack two weights per byte (w4a8)."""
        return "w4a8" if self.int8_mode == "w8a8" and self.actor_bits <= 4 else self.int8_mode

    def actor_quant(self) -> QuantConfig:
        """Quantization config of the actor's policy."""
        return QuantConfig(bits=self.actor_bits, granularity=self.granularity)

    def wire_quant(self) -> QuantConfig:
        """Quantization config of the published payload."""
        return QuantConfig(bits=self.comm_bits, granularity=self.granularity)


def resolve_backend(precision: ActorPrecision) -> str:
    """The concrete backend for `auto`: int8 kernel for integer bits when it is built, else fakequant."""
    if precision.backend != "auto":
        return precision.backend
    if precision.actor_bits == 32:
        return "fp32"
    if precision.actor_bits <= 8:
        from actorq_jax import kernels

        if kernels.kernel_available():
            return "int8"
        log.warning("int8 kernel not built on this machine; actors use fakequant (the same quantized weights with "
                    "float activations, at float speed)")
    return "fakequant"


def describe_backend(precision: ActorPrecision, backend: Optional[str] = None) -> str:
    """What computes a policy at `precision` (`backend`: resolved already): "fp32", "fakequant", or
    "int8/<packing>/<kernel path>"."""
    backend = backend or resolve_backend(precision)
    if backend != "int8":
        return backend
    from actorq_jax import kernels

    return f"int8/{precision.kernel_mode()}/{kernels.kernel_path()}"


def make_param_loader(precision: ActorPrecision) -> Callable[[Any], Any]:
    """Returns `load(wire_qparams) -> runnable params` for the actor's precision and backend."""
    backend = resolve_backend(precision)
    actor_q = precision.actor_quant()
    requantize = precision.actor_bits != precision.comm_bits and precision.actor_bits != 32

    def load(qparams: Any) -> Any:
        if requantize:
            # The wire carries another precision: bring it to float, then to the actor's bits.
            qparams = quantize(dequantize(qparams), actor_q)
        if backend == "int8":
            from actorq_jax import kernels

            params = kernels.pack_params(qparams, mode=precision.kernel_mode())
        else:
            params = dequantize(qparams)
        params = jax.device_put(params)
        jax.block_until_ready(params)
        return params

    return load
