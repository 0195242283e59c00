"""Loads the compiled int8 library once, registers its FFI targets, reports why if it cannot."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

# Environment variables read by this package.
ENV_LIBRARY = "ACTORQ_KERNEL_LIBRARY"  # path of the library to load instead of the built one
ENV_PATH = "ACTORQ_KERNEL_PATH"  # default instruction-set path: auto|scalar|avx2|avx512|amx|reference

TARGET_W8A32 = "actorq_int8_dense_w8a32"
TARGET_W8A8 = "actorq_int8_dense_w8a8"
TARGET_W4A8 = "actorq_int8_dense_w4a8"
TARGET_LAYER_NORM = "actorq_layer_norm"
TARGET_MLP = "actorq_mlp"

# FFI target name -> the handler symbol int8_dense.cc exports for it.
_TARGET_SYMBOLS = {
    TARGET_W8A32: "ActorqInt8DenseW8A32",
    TARGET_W8A8: "ActorqInt8DenseW8A8",
    TARGET_W4A8: "ActorqInt8DenseW4A8",
    TARGET_LAYER_NORM: "ActorqLayerNorm",
    TARGET_MLP: "ActorqMlp",
}

# Path names <-> the integer codes the C++ handlers take as the "path" attribute.
PATH_CODES = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3, "amx": 4}
PATH_NAMES = {code: name for name, code in PATH_CODES.items()}

# The handlers' signature version this Python code speaks (kAbiVersion in int8_dense.cc).
ABI_VERSION = 8


class _State:
    """What loading found: the ctypes library, or the reason there is none."""

    def __init__(self) -> None:
        self.lib: Optional[ctypes.CDLL] = None
        self.path: Optional[Path] = None
        self.reason: str = "not loaded yet"


_state: Optional[_State] = None
_lock = threading.Lock()


def library_path() -> Path:
    """Where the library is loaded from ($ACTORQ_KERNEL_LIBRARY, else next to the sources)."""
    # Imported here so that `python -m actorq_jax.kernels.build` does not find itself pre-imported.
    from actorq_jax.kernels.build import HERE, library_filename

    override = os.environ.get(ENV_LIBRARY)
    return Path(override) if override else HERE / library_filename()


def _load() -> _State:
    state = _State()
    path = library_path()
    state.path = path
    if not path.exists():
        state.reason = f"{path} does not exist (build it: python -m actorq_jax.kernels.build)"
        return state
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        for name, argtypes in (
            ("actorq_best_path", []),
            ("actorq_path_supported", [ctypes.c_int64]),
            ("actorq_set_num_threads", [ctypes.c_int64]),
            ("actorq_get_num_threads", []),
            ("actorq_abi_version", []),
            ("actorq_amx_min_rows", [ctypes.c_int64]),
        ):
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = None if name == "actorq_set_num_threads" else ctypes.c_int64
        lib.actorq_pack_panels.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                           ctypes.c_void_p, ctypes.c_void_p]
        lib.actorq_pack_panels.restype = None
        if lib.actorq_abi_version() != ABI_VERSION:
            raise ValueError(f"it speaks version {lib.actorq_abi_version()} of the kernel interface, "
                             f"this code needs {ABI_VERSION} (rebuild: python -m actorq_jax.kernels.build)")
        from jax.extend import ffi as jffi

        for target, symbol in _TARGET_SYMBOLS.items():
            jffi.register_ffi_target(target, jffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, AttributeError, RuntimeError, TypeError, ValueError) as exc:
        state.reason = f"cannot load {path}: {exc}"
        return state
    from actorq_jax.kernels.build import SOURCE

    if SOURCE.exists() and path.parent == SOURCE.parent and SOURCE.stat().st_mtime > path.stat().st_mtime:
        # Still usable (the FFI checks signatures at run time), but likely out of date.
        log.warning("%s is older than %s; rebuild with python -m actorq_jax.kernels.build",
                       path.name, SOURCE.name)
    state.lib = lib
    state.reason = "loaded"
    return state


def state() -> _State:
    """The process-wide load result (loads and registers on first use)."""
    global _state
    with _lock:
        if _state is None:
            _state = _load()
        return _state


def best_path() -> str:
    """Fastest path this CPU supports ("amx", "avx512", "avx2" or "scalar"), or "reference" without the library."""
    lib = state().lib
    return "reference" if lib is None else PATH_NAMES[int(lib.actorq_best_path())]


def path_supported(name: str) -> bool:
    """Whether the library is loaded and this CPU can run the named path."""
    lib = state().lib
    return lib is not None and bool(lib.actorq_path_supported(PATH_CODES[name]))
