"""Orbax checkpoints of a learner's state pytree plus JSON counters.

A checkpoint is `<directory>/<step>/` with the state and `counters/metadata`
(JSON: env_steps, learner_steps, the replay checkpoint's name, ...). Orbax
writes a step under a temporary name and renames it when complete, so a
directory named by digits alone is a finished checkpoint: `read_counters`
trusts only those, and needs neither JAX nor Orbax (the launcher calls it).
"""

import json
import logging
import shutil
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


class CheckpointUnreadable(ValueError):
    """No learner checkpoint in a directory reads back (each is damaged, or another state's)."""


def _first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."


class Checkpointer:
    """Saves `(state, counters)` under a directory, keeping the newest few."""

    def __init__(self, directory: Path, max_to_keep: int = 2):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = Path(directory).absolute()
        self.restored_step: Optional[int] = None
        self.unreadable: List[int] = []  # steps the last restore could not read back
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

    def restore(self, template: Any, set_aside: bool = True) -> Optional[Tuple[Any, Dict[str, Any]]]:
        """The newest `(state, counters)` that reads back, shaped like `template`; None when nothing is saved.

        With `set_aside`, a damaged checkpoint is renamed `<step>.unreadable` (kept for a look, no longer a
        checkpoint) when an older one reads back. CheckpointUnreadable, naming each step and why, when none does.
        `restored_step` is the step read.
        """
        ocp = self._ocp
        failed: List[Tuple[int, str]] = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(state=ocp.args.StandardRestore(template), counters=ocp.args.JsonRestore()),
                )
            except (ValueError, OSError) as error:  # what TensorStore and JSON raise on a damaged or missing file
                failed.append((step, _first_line(error)))
                continue
            for bad, why in failed:
                log.warning("checkpoint at learner step %d cannot be read (%s); going on from step %d", bad, why, step)
                if set_aside:
                    # Else the next restore, or the replay service's choice of checkpoint, would take it again.
                    aside = self.directory / f"{bad}.unreadable"
                    shutil.rmtree(aside, ignore_errors=True)
                    (self.directory / str(bad)).rename(aside)
                    log.warning("moved the checkpoint at learner step %d to %s", bad, aside)
            if failed and set_aside:
                self._manager.reload()
            self.restored_step, self.unreadable = step, [bad for bad, _ in failed]
            log.info("restored checkpoint at learner step %d", step)
            return restored["state"], dict(restored["counters"])
        if not failed:
            return None
        raise CheckpointUnreadable(
            f"no learner checkpoint in {self.directory} can be read: "
            + "; ".join(f"step {step}: {why}" for step, why in failed)
            + " (a damaged disk, a file removed, or a checkpoint of another version's networks); nothing was "
              "changed: start a new run, or resume with the version that wrote them")

    def kept_counters(self) -> List[Dict[str, Any]]:
        """Counters of every checkpoint still kept, oldest first."""
        return [c for c in (read_counters(self.directory, s) for s in finished_steps(self.directory)) if c]

    def close(self) -> None:
        """Releases the manager's background resources."""
        self._manager.close()
