"""Orbax checkpoints of a learner's state pytree plus JSON counters."""

import logging
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves `(state, counters)` under a directory, keeping the newest few."""

    def __init__(self, directory: Path, max_to_keep: int = 2):
        self._manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def save(self, step: int, state: Any, counters: Dict[str, Any]) -> None:
        """Writes a checkpoint for `step` and waits until it is on disk."""
        if step in self._manager.all_steps():
            return
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), counters=ocp.args.JsonSave(counters)),
        )
        self._manager.wait_until_finished()

    def latest_step(self) -> Optional[int]:
        """The newest saved step, or None."""
        return self._manager.latest_step()

    def restore(self, template: Any) -> Optional[Tuple[Any, Dict[str, Any]]]:
        """The newest `(state, counters)`, shaped like `template`; None when nothing is saved."""
        step = self._manager.latest_step()
        if step is None:
            return None
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(template), counters=ocp.args.JsonRestore()),
        )
        log.info("restored checkpoint at learner step %d", step)
        return restored["state"], dict(restored["counters"])

    def close(self) -> None:
        """Releases the manager's background resources."""
        self._manager.close()
