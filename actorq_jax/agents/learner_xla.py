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
# Two XLA:CPU passes that cost the step time without changing what it computes:
# - tree_reduction_rewriter splits every reduction longer than 32 (LayerNorm's means, the
#   softmax over 51 atoms, bias gradients, global norms) into a windowed reduce that XLA:CPU
#   runs as a slow, unvectorized loop; without it each is one vectorized reduce loop;
# - onednn-ops-rewriter hands LayerNorm and softmax to oneDNN calls that XLA cannot fuse
#   with the work around them.
# The oneDNN matmul rewrite, which the step gains from, is another pass and stays.
SKIPPED_PASSES = ("tree_reduction_rewriter", "onednn-ops-rewriter")
SKIP_PASSES = f"--xla_disable_hlo_passes={','.join(SKIPPED_PASSES)}"


def _version(text: str) -> Tuple[int, ...]:
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def learner_xla_flags(existing: str = "", jaxlib_version: Optional[str] = None) -> str:
    """`existing` XLA_FLAGS plus the learner's where this jaxlib has its runtime; a flag already set wins."""
    if jaxlib_version is None:
        try:
            jaxlib_version = metadata.version("jaxlib")
        except metadata.PackageNotFoundError:
            return existing
    low, high = NO_THUNK_JAXLIB
    # Measured on the jaxlib versions with both runtimes only (skipping the passes gains under either runtime).
    if not low <= _version(jaxlib_version) < high:
        return existing
    flags = [existing] if existing else []
    if "xla_cpu_use_thunk_runtime" not in existing:
        flags.append(NO_THUNK_RUNTIME)
    if "xla_disable_hlo_passes" not in existing:
        flags.append(SKIP_PASSES)
    return " ".join(flags)
