"""The results-directory layout: one name per file, the globs that find actors' files, and one launcher per
directory."""

import json
import time
from pathlib import Path

import pytest

from actorq_jax.run_dir import ResultsDirInUse, RunDir, claimed


def test_paths_lie_under_the_root_with_their_documented_names(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.config == tmp_path / "config.json"
    assert run.summary == tmp_path / "summary.json"
    assert run.eval_csv == tmp_path / "eval.csv"
    assert run.learner_csv == tmp_path / "learner.csv"
    assert run.log("actor_2") == tmp_path / "logs" / "actor_2.log"
    assert run.status_file("replay") == tmp_path / "status" / "replay.json"
    assert run.actor_csv(7) == tmp_path / "actors" / "actor_7.csv"
    assert run.checkpoints == tmp_path / "checkpoints"
    assert run.replay_checkpoints == tmp_path / "replay_checkpoints"
    assert RunDir(str(tmp_path)) == run and hash(RunDir(str(tmp_path))) == hash(run)


def test_actor_csvs_finds_every_actor_file_and_nothing_else(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.actor_csvs() == []  # no actors/ yet
    run.actors.mkdir()
    for actor_id in (10, 0, 3):
        run.actor_csv(actor_id).write_text("episode\n")
    (run.actors / "notes.txt").write_text("not an actor's file")
    assert [p.name for p in run.actor_csvs()] == ["actor_0.csv", "actor_10.csv", "actor_3.csv"]


def test_a_claimed_directory_is_refused_to_a_second_claim_naming_the_launcher_and_free_once_released(
        tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.status.mkdir()
    run.status_file("launcher").write_text(json.dumps({"pid": 4242, "start_time": 1.0}))
    with claimed(tmp_path):
        started = time.monotonic()
        with pytest.raises(ResultsDirInUse, match=r"is in use.*pid 4242"):
            with claimed(tmp_path, wait_s=0.3):
                raise AssertionError("claimed twice")
        assert time.monotonic() - started >= 0.3  # waited for a launcher that may be ending, then gave up
    with claimed(tmp_path, wait_s=0.0):
        assert list(tmp_path.iterdir()) == [run.status]  # the claim leaves no file behind
