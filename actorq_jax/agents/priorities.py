"""Prioritized replay's write-back loop, behind the agent contract (a uniform-replay agent has none).

After each SGD call the learner hands the sampled batch and the metrics to the
builder's `PriorityFeedback`, which writes the items' new priorities to the
table and keeps the largest priority written so far. New items enter at that
largest priority: the learner publishes it in the variables' meta, each actor
reads its insertion priority back from that meta, and the learner's checkpoint
counters keep it, so a restarted learner (or a resumed run) goes on from it.
"""

from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional

import numpy as np

from actorq_jax.replay import ReplayBatch, update_priorities

# The name under which the largest priority travels in the variables' meta and rests in checkpoint counters.
MAX_PRIORITY = "max_priority"


class PriorityUpdate(NamedTuple):
    """New priorities for sampled items (keys as in ReplayBatch.keys)."""

    keys: np.ndarray
    priorities: np.ndarray


class PriorityFeedback:
    """Writes a step's priorities back to the replay table and tracks the largest, at which actors insert.

    `compute(batch, metrics)` is the agent's priority rule (None: nothing to write for that step).
    """

    def __init__(self, table: str, compute: Callable[[ReplayBatch, Any], Optional[PriorityUpdate]],
                 initial: float = 1.0):
        self.table = table
        self.compute = compute
        self.max_priority = float(initial)

    def restore(self, counters: Mapping[str, Any]) -> None:
        """Continues from a learner checkpoint's counters (what `counters()` saved; nothing when absent)."""
        self.max_priority = float(counters.get(MAX_PRIORITY, self.max_priority))

    def counters(self) -> Dict[str, float]:
        """What a learner checkpoint keeps of the feedback."""
        return {MAX_PRIORITY: self.max_priority}

    def meta(self) -> Dict[str, float]:
        """The numbers the learner publishes to the actors with their parameters."""
        return {MAX_PRIORITY: self.max_priority}

    def insertion_priority(self, meta: Mapping[str, float]) -> Optional[float]:
        """The priority an actor's new items enter at, read from the published meta (None: the adder's default)."""
        return meta.get(MAX_PRIORITY)

    def write_back(self, client: Any, batch: ReplayBatch, metrics: Any) -> None:
        """Sets the sampled items' new priorities on the table and raises the largest; the replay service's
        errors propagate, after the largest was raised (the priorities were computed all the same)."""
        update = self.compute(batch, metrics)
        if update is None:
            return
        self.max_priority = max(self.max_priority, float(np.max(update.priorities)))
        # A multi-step call writes back every step's priorities, later steps last.
        update_priorities(client, self.table, np.ravel(update.keys), np.ravel(update.priorities))
