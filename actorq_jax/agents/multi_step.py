"""Several SGD steps in one jitted call: the agent's pure `sgd_step` scanned over batches stacked on a leading axis.

One call of `multi_sgd_step(builder.sgd_step, n)` does exactly what n calls of
`builder.sgd_step` do, in the same order, but dispatches once: the per-call
cost (Python, pytree flattening, launching the executable, returning the
state) is paid once per n steps. The learner's loop becomes

    run = multi_sgd_step(builder.sgd_step, n)             # once
    batches = [next(dataset) for _ in range(n)]          # ReplayBatch each, as today
    stacked = stack_batches(batches)                     # fields [n, B, ...]
    state, metrics = run(state, stacked)                 # metrics: fields [n, ...]
    update = builder.priority_update(stacked, metrics)   # every step's priorities (None: uniform)
    log(last_step_metrics(metrics))                      # the scalars of the n-th step

Prioritized replay then sees priorities written back once per n steps, as a
learner with n batches in flight would.
"""

from typing import Any, Callable, Sequence, Tuple

import jax
import numpy as np

from actorq_jax.agents.builder import Metrics, SgdStep
from actorq_jax.replay import ReplayBatch

# `(state, stacked ReplayBatch) -> (state, metrics stacked per step)`.
MultiSgdStep = Callable[[Any, ReplayBatch], Tuple[Any, Metrics]]


def multi_sgd_step(sgd_step: SgdStep, num_steps: int, donate: bool = False) -> MultiSgdStep:
    """`num_steps` SGD steps in one jitted call: `(state, stacked) -> (state, metrics)`.

    `stacked` is a ReplayBatch whose every field has a leading axis of `num_steps` (see
    stack_batches); step i trains on `stacked[i]`. The returned metrics hold every step's
    metrics stacked on that axis (`metrics[k][i]` is step i's), so a prioritized agent's
    `priority_update(stacked, metrics)` writes back every step's priorities (later steps last,
    so an item sampled twice keeps its newest priority); last_step_metrics gives the n-th
    step's for logging. `sgd_step` must be traceable (jnp, not np, on its inputs) and must not
    read `batch.keys`: the uint64 keys stay outside jit (x64 is off) and the scan sees None.

    With `donate`, the input state's buffers are reused for the output: faster by a copy of
    the state per call, but the caller must hold no other reference to the old state (a
    publisher thread still reading `actor_params(old_state)` would find its arrays deleted),
    so copy whatever outlives the call first. Off by default for that reason.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")

    def body(state: Any, batch: ReplayBatch) -> Tuple[Any, Metrics]:
        return sgd_step(state, batch)

    def run(state: Any, stacked: ReplayBatch) -> Tuple[Any, Metrics]:
        return jax.lax.scan(body, state, stacked, length=num_steps)

    jitted = jax.jit(run, donate_argnums=(0,) if donate else ())

    def call(state: Any, stacked: ReplayBatch) -> Tuple[Any, Metrics]:
        leading = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree_util.tree_leaves(stacked)}
        if leading != {num_steps}:
            raise ValueError(f"every field of the stacked batch needs a leading axis of {num_steps}, got {leading}")
        return jitted(state, stacked._replace(keys=None))

    return call


def stack_batches(batches: Sequence[ReplayBatch]) -> ReplayBatch:
    """The batches stacked on a new leading axis, in order (host numpy arrays, as the dataset yields them)."""
    if not batches:
        raise ValueError("stack_batches needs at least one batch")
    return jax.tree_util.tree_map(lambda *fields: np.stack(fields), *batches)


def last_step_metrics(metrics: Metrics) -> Metrics:
    """The last step's metrics out of multi_sgd_step's stacked ones."""
    return {name: value[-1] for name, value in metrics.items()}
