"""Compiles the int8 dense-layer library against the installed jaxlib's FFI headers.

Run by setup.py on install, or by hand: ``python -m actorq_jax.kernels.build``.
Needs a C++17 compiler with AVX-512 VNNI intrinsics (g++ >= 9; tested with g++ 12.2);
the library itself is built without -m flags and runs on any x86-64 CPU.
This module imports nothing from actorq_jax so setup.py can load it on its own.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "int8_dense.cc"
LIBRARY_STEM = "_int8_kernels"


def library_filename() -> str:
    """File name of the compiled library (with this interpreter's extension suffix)."""
    return LIBRARY_STEM + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def ffi_include_dir() -> str:
    """Directory holding ``xla/ffi/api/ffi.h`` from the installed jaxlib."""
    from jax.extend import ffi as jffi  # imported here: jax is heavy and only needed to build

    return jffi.include_dir()


def compile_command(output: Path, include_dir: str, compiler: str | None = None, portable: bool = False) -> list:
    """The compiler command line that builds the library into ``output`` (``portable``: scalar code only)."""
    cxx = shlex.split(compiler or os.environ.get("CXX", "g++"))
    # No -march/-mavx2: SIMD code is enabled per function with target attributes.
    # No -fvisibility=hidden: XLA_FFI_DEFINE_HANDLER_SYMBOL does not export the symbol.
    # No -ffast-math: W8A8 activation rounding must match the jnp reference bit for bit.
    return cxx + [
        "-std=c++17",
        "-O3",
        "-fPIC",
        "-shared",
        "-pthread",
        f"-I{include_dir}",
        *(["-DACTORQ_PORTABLE_ONLY"] if portable else []),
        str(SOURCE),
        "-o",
        str(output),
    ]


def build(output: Path | None = None, compiler: str | None = None, verbose: bool = False,
          portable: bool = False) -> Path:
    """Compiles the library (default: next to this file; ``portable``: scalar code only); RuntimeError on failure."""
    output = Path(output) if output is not None else HERE / library_filename()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    cmd = compile_command(tmp, ffi_include_dir(), compiler, portable)
    if verbose:
        print(" ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise RuntimeError(f"cannot run C++ compiler {cmd[0]!r}: {exc}") from exc
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(
            f"compiling {SOURCE.name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    # Atomic replace: a process that already mapped the old file keeps a valid copy.
    os.replace(tmp, output)
    return output


def main(argv: list | None = None) -> int:
    """Command-line entry point: builds the library and prints its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=None, help="where to write the library")
    parser.add_argument("--cxx", default=None, help="C++ compiler (default: $CXX or g++)")
    parser.add_argument("--verbose", action="store_true", help="print the compiler command")
    parser.add_argument("--portable", action="store_true", help="scalar code only (no x86 SIMD paths)")
    args = parser.parse_args(argv)
    try:
        path = build(args.output, args.cxx, args.verbose, args.portable)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
