"""A learner checkpoint that cannot be read back is passed over for the one before it, and kept aside; when none
reads back the error names each step and why."""

import shutil
from pathlib import Path

import jax.numpy as jnp
import pytest

from actorq_jax.launch.checkpoint import Checkpointer, CheckpointUnreadable, finished_steps, read_counters


def _template() -> dict:
    # Built in the test, not at import: an array made at collection starts JAX's threads in every pytest worker,
    # and a later fork there (a Ray test's node) warns of a deadlock.
    return {"w": jnp.ones((8, 8)), "b": jnp.zeros(8)}


def _saved(directory: Path, steps=(100, 200)) -> None:
    checkpointer = Checkpointer(directory)
    for step in steps:
        checkpointer.save(step, {"w": jnp.full((8, 8), float(step)), "b": jnp.zeros(8)}, {"learner_steps": step})
    checkpointer.close()


def _damage(directory: Path, step: int) -> None:
    """Empties every data file of a checkpoint's state, as a full disk or a bad copy leaves it."""
    for path in (directory / str(step) / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"")


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_restored(tmp_path, caplog):
    _saved(tmp_path)
    _damage(tmp_path, 200)
    checkpointer = Checkpointer(tmp_path)
    state, counters = checkpointer.restore(_template())
    assert counters == {"learner_steps": 100} and float(state["w"][0, 0]) == 100.0
    assert checkpointer.restored_step == 100
    assert "checkpoint at learner step 200 cannot be read" in caplog.text
    # Kept for a look, and no longer a checkpoint: the replay service's choice and the next restore skip it.
    assert (tmp_path / "200.unreadable" / "state").is_dir() and not (tmp_path / "200").exists()
    assert finished_steps(tmp_path) == [100] and read_counters(tmp_path)["learner_steps"] == 100
    # The manager knows it too: the next checkpoint is written beside step 100, which stays.
    checkpointer.save(300, _template(), {"learner_steps": 300})
    assert checkpointer.latest_step() == 300 and finished_steps(tmp_path) == [100, 300]
    checkpointer.close()


def test_a_read_only_restore_passes_a_damaged_checkpoint_over_and_leaves_it(tmp_path):
    _saved(tmp_path)
    _damage(tmp_path, 200)
    checkpointer = Checkpointer(tmp_path)
    _, counters = checkpointer.restore(_template(), set_aside=False)
    checkpointer.close()
    assert counters["learner_steps"] == 100 and finished_steps(tmp_path) == [100, 200]


def test_no_readable_checkpoint_is_an_error_naming_each_step_and_moves_nothing(tmp_path):
    _saved(tmp_path)
    _damage(tmp_path, 200)
    shutil.rmtree(tmp_path / "100" / "state" / "d")
    checkpointer = Checkpointer(tmp_path)
    with pytest.raises(CheckpointUnreadable) as error:
        checkpointer.restore(_template())
    checkpointer.close()
    message = str(error.value)
    assert message.startswith(f"no learner checkpoint in {tmp_path} can be read: step 200: ")
    assert "; step 100: " in message and "\n" not in message and "nothing was changed" in message
    assert finished_steps(tmp_path) == [100, 200]  # nothing chosen for the user


def test_a_checkpoint_of_another_state_is_unreadable_not_a_library_traceback(tmp_path):
    _saved(tmp_path, steps=(100,))
    checkpointer = Checkpointer(tmp_path)
    with pytest.raises(CheckpointUnreadable, match="step 100: .*mismatch"):
        checkpointer.restore({"w": jnp.ones((8, 8)), "other": jnp.zeros(8)})
    checkpointer.close()


def test_nothing_saved_restores_nothing(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    assert checkpointer.restore(_template()) is None and checkpointer.restored_step is None
    checkpointer.close()
