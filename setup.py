"""Installs actorq_jax; dependencies are pinned in requirements.txt."""

import importlib.util
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent


def _requirements(name: str = "requirements.txt") -> list:
    lines = (HERE / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


class _BuildInt8Kernel(build_ext):
    """Compiles actorq_jax/kernels/int8_dense.cc with actorq_jax/kernels/build.py.

    A failed build only warns: the package then falls back to the jnp reference.
    """

    def build_extension(self, ext):
        spec = importlib.util.spec_from_file_location(
            "_actorq_kernel_build", HERE / "actorq_jax" / "kernels" / "build.py"
        )
        builder = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(builder)  # loaded by path: the package itself is not importable yet
        output = Path(self.get_ext_fullpath(ext.name))
        try:
            builder.build(output, verbose=True)
        except (RuntimeError, ImportError) as exc:
            self.warn(f"int8 kernel not built ({exc}); actorq_jax.kernels will use the jnp reference")


_TEST_ONLY = ("pytest", "pytest-timeout", "ruff", "nbclient", "nbformat", "ipykernel")
_reqs = _requirements()

setup(
    name="actorq-jax",
    version="0.1.0",
    description="ActorQ: quantized distributed reinforcement learning in JAX with Reverb",
    packages=find_packages(include=["actorq_jax", "actorq_jax.*"]),
    python_requires=">=3.9,<3.12",
    install_requires=[r for r in _reqs if not r.startswith(_TEST_ONLY)],
    extras_require={"test": [r for r in _reqs if r.startswith(_TEST_ONLY)], "bench": _requirements("requirements-bench.txt")},
    ext_modules=[Extension("actorq_jax.kernels._int8_kernels", sources=[])],
    cmdclass={"build_ext": _BuildInt8Kernel},
)
