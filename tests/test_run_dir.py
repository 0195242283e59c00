"""The results-directory layout: one name per file, and the globs that find actors' files."""

from pathlib import Path

from actorq_jax.run_dir import RunDir


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
