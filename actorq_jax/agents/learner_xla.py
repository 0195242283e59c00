"""XLA:CPU flags that make the learner's SGD step cheaper on this JAX (imports no JAX: read before it starts).

benchmarks/learner.py measures them side by side against the default runtime. XLA
reads XLA_FLAGS once, when the backend starts, so a process applies them before its
first computation (best: before importing jax), e.g. with
`os.environ["XLA_FLAGS"] = learner_xla_flags(os.environ.get("XLA_FLAGS", ""))`.
"""

from importlib import metadata
from typing import Optional, Tuple

# The runtime XLA:CPU used before its thunk runtime became the default (jaxlib 0.4.32): it
# fuses the step's elementwise work into fewer, larger loops and does not split them over a
# thread pool. jaxlib 0.7 dropped it ("CpuExecutable has no thunks"), so it is only offered
# where it exists.
NO_THUNK_RUNTIME = "--xla_cpu_use_thunk_runtime=false"
NO_THUNK_JAXLIB = ((0, 4, 32), (0, 7, 0))  # [first, last) jaxlib versions with both runtimes


def _version(text: str) -> Tuple[int, ...]:
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def learner_xla_flags(existing: str = "", jaxlib_version: Optional[str] = None) -> str:
    """`existing` XLA_FLAGS plus the learner's (NO_THUNK_RUNTIME where this jaxlib has it); one already set wins."""
    if jaxlib_version is None:
        try:
            jaxlib_version = metadata.version("jaxlib")
        except metadata.PackageNotFoundError:
            return existing
    low, high = NO_THUNK_JAXLIB
    if not low <= _version(jaxlib_version) < high or "xla_cpu_use_thunk_runtime" in existing:
        return existing
    return f"{existing} {NO_THUNK_RUNTIME}".strip()
