"""Run a Haiku network on quantized or int8-packed parameters.

A Haiku policy (``hk.transform``, as Acme builds them from ``hk.Linear`` /
``hk.nets.MLP``) has parameters ``{module_name: {"w": ..., "b": ...}}``. The
quantization transform, the wire format and the actors' parameter loader only
look at leaves (shape and dtype), so they take such a tree as it is::

    f = hk.without_apply_rng(hk.transform(policy_fn))
    params = f.init(key, obs)
    arrays = to_wire(quantize(params, QuantConfig(bits=8)), version=step)
    qparams, _ = from_wire(arrays, like=quantize(params, QuantConfig(bits=8)))
    runnable = make_param_loader(ActorPrecision(actor_bits=8, comm_bits=8))(qparams)
    actions = jax.jit(quantized_apply(f.apply))(runnable, obs)

``quantized_apply`` is what Haiku itself lacks: ``hk.Linear`` asks for a
float ``w`` of the float shape, which an int8-packed weight is not. It runs
every ``hk.Linear`` (and subclass) whose ``w`` is a ``QuantizedTensor`` or an
``Int8DenseWeight`` through ``networks.apply_dense`` (the int8 kernel for
packed weights), and hands any other module a float32 copy of a quantized
parameter, so conv or embedding layers still run, in float.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import haiku as hk
import jax.numpy as jnp

from actorq_jax import kernels, quantization
from actorq_jax.networks.layers import apply_dense


def _is_compressed(x: Any) -> bool:
    return isinstance(x, (quantization.QuantizedTensor, kernels.Int8DenseWeight))


def _as_float(x: Any) -> Any:
    """float32 weights of a QuantizedTensor or Int8DenseWeight; anything else as it is."""
    if isinstance(x, kernels.Int8DenseWeight):
        return x.unpack().astype(jnp.float32) * x.scale
    if isinstance(x, quantization.QuantizedTensor):
        return quantization.dequantize_tensor(x)
    return x


def _compressed_linears(params: Mapping[str, Any]) -> dict:
    """{module name: its params} for modules whose "w" is quantized or packed."""
    return {name: p for name, p in params.items() if isinstance(p, Mapping) and _is_compressed(p.get("w"))}


def _float_getter(next_getter: Callable, value: Any, context: Any) -> Any:
    del context
    return next_getter(_as_float(value))


def quantized_apply(apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a Haiku ``apply`` so it also takes quantized (QuantizedTensor) or int8-packed (Int8DenseWeight) params.

    ``apply_fn`` is the ``apply`` of ``hk.transform``, ``hk.without_apply_rng``
    or ``hk.transform_with_state``; the wrapper takes the same arguments, with
    params that may come from ``quantize``, ``dequantize``,
    ``kernels.pack_params`` or ``launch.precision.make_param_loader``. Float
    params run exactly as ``apply_fn`` runs them. Works under ``jax.jit``.
    """

    def apply(params: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        linears = _compressed_linears(params)

        def intercept(next_f: Callable, f_args: tuple, f_kwargs: dict, context: hk.MethodContext) -> Any:
            module = context.module
            if context.method_name == "__call__" and isinstance(module, hk.Linear) and module.module_name in linears:
                p = linears[module.module_name]
                inputs = f_args[0] if f_args else f_kwargs["inputs"]
                return apply_dense(inputs, p["w"], p.get("b"))
            # The getter has to be entered inside the transform, i.e. here, in a module's method.
            with hk.custom_getter(_float_getter):
                return next_f(*f_args, **f_kwargs)

        with hk.intercept_methods(intercept):
            return apply_fn(params, *args, **kwargs)

    return apply
