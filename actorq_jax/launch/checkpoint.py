"""Orbax checkpoints of a learner's state pytree plus JSON counters.

A checkpoint is `<directory>/<step>/` with the state and `counters/metadata`
(JSON: env_steps, learner_steps, the replay checkpoint's name, ...). Orbax
writes a step under a temporary name and renames it when complete, so a
directory named by digits alone is a finished checkpoint: `read_counters`
trusts only those, and needs neither JAX nor Orbax (the launcher calls it).
"""

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

log = logging.getLogger(__name__)


def finished_steps(directory: Path) -> List[int]:
    """Steps with a complete checkpoint in `directory`, oldest first."""
    try:
        names = [p.name for p in Path(directory).iterdir() if p.is_dir()]
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and (Path(directory) / n / "counters" / "metadata").exists())


def read_counters(directory: Path, step: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """The counters of checkpoint `step` (default: the newest); None when there is none."""
    steps = finished_steps(directory)
    if step is None:
        if not steps:
            return None
        step = steps[-1]
    try:
        return dict(json.loads((Path(directory) / str(step) / "counters" / "metadata").read_text()))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class Checkpointer:
    """Saves `(state, counters)` under a directory, keeping the newest few."""

    def __init__(self, directory: Path, max_to_keep: int = 2):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def has(self, step: int) -> bool:
        """Whether a checkpoint of `step` exists."""
        return step in self._manager.all_steps()

    def save(self, step: int, state: Any, counters: Dict[str, Any]) -> None:
        """Writes a checkpoint for `step` and waits until it is on disk."""
        if self.has(step):
            return
        ocp = self._ocp
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
        ocp = self._ocp
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(template), counters=ocp.args.JsonRestore()),
        )
        log.info("restored checkpoint at learner step %d", step)
        return restored["state"], dict(restored["counters"])

    def kept_counters(self) -> List[Dict[str, Any]]:
        """Counters of every checkpoint still kept, oldest first."""
        return [c for c in (read_counters(self.directory, s) for s in finished_steps(self.directory)) if c]

    def close(self) -> None:
        """Releases the manager's background resources."""
        self._manager.close()
