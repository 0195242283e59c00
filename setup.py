"""Installs actorq_jax; dependencies are pinned in requirements.txt."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def _requirements() -> list:
    lines = (HERE / "requirements.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


_TEST_ONLY = ("pytest", "pytest-timeout", "nbclient", "nbformat", "ipykernel")
_reqs = _requirements()

setup(
    name="actorq-jax",
    version="0.1.0",
    description="ActorQ: quantized distributed reinforcement learning in JAX with Reverb",
    packages=find_packages(include=["actorq_jax", "actorq_jax.*"]),
    python_requires=">=3.9,<3.12",
    install_requires=[r for r in _reqs if not r.startswith(_TEST_ONLY)],
    extras_require={"test": [r for r in _reqs if r.startswith(_TEST_ONLY)]},
)
