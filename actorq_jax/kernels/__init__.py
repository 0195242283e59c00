"""Fast CPU int8 inference for actors: XLA FFI dense-layer kernels plus their pure-jnp reference.

    from actorq_jax.kernels import pack_params, int8_dense, kernel_available, set_num_threads

    int8_params = pack_params(quantize(params, QuantConfig(bits=8)))   # repack once at load
    actions = policy.apply(int8_params, obs)                           # the whole MLP -> one int8_mlp call

``int8_mlp`` runs a stack of dense layers and layer norms (with their
activations) as one FFI call, equal bit for bit to ``int8_dense`` and
``layer_norm`` called layer by layer.

The compiled library (``python -m actorq_jax.kernels.build``; setup.py builds it
on install) picks AMX, AVX-512 VNNI, AVX2+FMA or portable scalar code at run time
(AMX: AVX-512 plus AMX-INT8 tile products for the int8 layers at batch 12 and up
for W8A8, 24 and up for W4A8, where the CPU has the tiles and Linux grants them).
Without it every call falls back to ``reference_int8_dense`` after one warning.
"""

from actorq_jax.kernels import _library, dense
from actorq_jax.kernels.dense import (
    ACTIVATIONS,
    Int8DenseWeight,
    MlpDense,
    MlpLayerNorm,
    int8_dense,
    int8_mlp,
    layer_norm,
    pack_dense,
    pack_params,
    quantize_rows,
    reference_int8_dense,
    reference_layer_norm,
)


def kernel_available() -> bool:
    """Whether the compiled int8 library is loaded (otherwise int8_dense uses the jnp reference)."""
    return _library.state().lib is not None


def kernel_path() -> str:
    """The path int8_dense uses by default: $ACTORQ_KERNEL_PATH where it names one, else the fastest this CPU has."""
    held = dense._default_path()
    if held == "auto" or _library.state().lib is None:
        return _library.best_path()  # "reference" without the library
    return held


def amx_min_rows(mode: str) -> int:
    """The batch from which the "amx" path multiplies ``mode`` ("w8a8" or "w4a8") on AMX tiles (below: AVX-512 VNNI)."""
    if mode not in ("w8a8", "w4a8"):
        raise ValueError(f"mode must be one of ('w8a8', 'w4a8'), got {mode!r}")
    lib = _library.state().lib
    if lib is None:
        raise RuntimeError(describe_kernel())
    return int(lib.actorq_amx_min_rows(dense._OP_CODES[mode]))


def describe_kernel() -> str:
    """One line naming the chosen path, the library file and the thread count (or why it is missing)."""
    state = _library.state()
    if state.lib is None:
        return f"int8 kernel unavailable ({state.reason}); using the jnp reference"
    path = kernel_path()
    if path == "amx":
        path = (f"amx path (AMX tiles from batch {amx_min_rows('w8a8')} for W8A8 and {amx_min_rows('w4a8')} "
                f"for W4A8; AVX-512 VNNI below)")
    else:
        path += " path"
    if dense._default_path() != "auto":
        path += f" (held by ${_library.ENV_PATH})"
    return f"int8 kernel: {path}, {get_num_threads()} thread(s), {state.path}"


def set_num_threads(n: int) -> None:
    """Sets how many threads each int8 kernel call may use (default 1; takes effect at once, also in jitted code)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"number of threads must be an int >= 1, got {n!r}")
    lib = _library.state().lib
    if lib is not None:
        lib.actorq_set_num_threads(n)


def get_num_threads() -> int:
    """Threads each int8 kernel call may use (1 when the library is missing)."""
    lib = _library.state().lib
    return 1 if lib is None else int(lib.actorq_get_num_threads())


__all__ = [
    "ACTIVATIONS",
    "Int8DenseWeight",
    "pack_dense",
    "int8_dense",
    "int8_mlp",
    "MlpDense",
    "MlpLayerNorm",
    "reference_int8_dense",
    "layer_norm",
    "reference_layer_norm",
    "quantize_rows",
    "pack_params",
    "kernel_available",
    "kernel_path",
    "amx_min_rows",
    "describe_kernel",
    "set_num_threads",
    "get_num_threads",
]
