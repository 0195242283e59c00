"""TensorBoard export: a run's CSV rows become scalars that TensorBoard's own reader finds, row by row as they come."""

import contextlib
import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from launch_support import ENV, stop_all, wait_for

from actorq_jax.launch.run_rows import drop_rows_after
from actorq_jax.launch.runtime import free_port
from actorq_jax.run_dir import RunDir
from actorq_jax.telemetry import ACTOR_FIELDS, EVAL_FIELDS, CsvLogger
from actorq_jax.telemetry.tensorboard import CsvFollower, RunScalars


def _scalars(logdir: Path) -> dict:
    """{tag: [(step, value), ...]} read back by TensorBoard's event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _actor_row(env_steps: int, episode_return: float) -> dict:
    row = {k: 0.0 for k in ACTOR_FIELDS}
    row.update(actor_id=1, incarnation="a", episode=env_steps // 100, env_steps=env_steps, episode_length=100,
               episode_return=episode_return, env_step_s=0.02, inference_s=0.03)
    return row


def test_rows_become_scalars_of_their_stream_at_their_step(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    learner = CsvLogger(run.learner_csv, ["learner_steps", "wall_seconds", "critic_loss"], flush_every_s=0)
    evals = CsvLogger(run.eval_csv, EVAL_FIELDS, flush_every_s=0)
    actor = CsvLogger(run.actor_csv(1), ACTOR_FIELDS, flush_every_s=0)
    learner.write({"learner_steps": 100, "wall_seconds": 3.0, "critic_loss": 0.5})
    evals.write({"wall_seconds": 4.0, "env_steps": 900, "learner_steps": 100, "policy": "fp32", "bits": 32,
                 "episode": 0, "return": 812.5, "final": False})
    evals.write({"wall_seconds": 4.0, "env_steps": 900, "learner_steps": 100, "policy": "actor", "bits": 8,
                 "episode": 0, "return": 790.0, "final": False})
    actor.write(_actor_row(200, 41.0))
    scalars = RunScalars(tmp_path)
    assert scalars.poll() == 4
    learner.write({"learner_steps": 200, "wall_seconds": 6.0, "critic_loss": 0.25})
    assert scalars.poll() == 1  # only the new row
    assert scalars.poll() == 0
    scalars.close()

    assert _scalars(run.tensorboard / "learner")["learner/critic_loss"] == [(100, 0.5), (200, 0.25)]
    board = _scalars(run.tensorboard / "eval")
    assert board["eval/return_fp32"] == [(100, 812.5)] and board["eval/return_actor"] == [(100, 790.0)]
    board = _scalars(run.tensorboard / "actor_1")
    assert board["actor/episode_return"] == [(200, 41.0)]
    assert board["actor_ms_per_step/inference"] == [(200, pytest.approx(0.3))]  # 30 ms over 100 steps
    assert board["actor/env_steps_per_s"] == [(200, pytest.approx(2000.0))]  # 100 steps in 50 ms of phases


def test_a_follower_waits_for_whole_lines_and_rereads_a_rewritten_file(tmp_path: Path) -> None:
    path = tmp_path / "learner.csv"
    follower = CsvFollower(path)
    assert follower.new_rows() == []  # no file yet
    path.write_text("learner_steps,loss\n10,0.5\n20,0.")
    assert follower.new_rows() == [{"learner_steps": 10.0, "loss": 0.5}]  # the cut line waits
    with open(path, "a") as f:
        f.write("25\n")
    assert follower.new_rows() == [{"learner_steps": 20.0, "loss": 0.25}]
    path.write_text("learner_steps,loss\n10,0.5\n")  # a restored learner dropped the rows past its checkpoint
    assert follower.new_rows() == [{"learner_steps": 10.0, "loss": 0.5}] and follower.rewritten
    assert follower.new_rows() == [] and not follower.rewritten


def test_a_follower_rereads_a_file_rewritten_and_grown_past_its_offset_before_it_looked(tmp_path: Path) -> None:
    path = tmp_path / "eval.csv"
    with CsvLogger(path, ["learner_steps", "return"], flush_every_s=0) as log:
        for step in (50, 100, 150):
            log.write({"learner_steps": step, "return": 1.0})
    follower = CsvFollower(path)
    assert [r["learner_steps"] for r in follower.new_rows()] == [50, 100, 150]
    # A restored learner's evaluations: the rows past step 50 dropped (into a new file), then longer rows
    # appended, all between two looks.
    drop_rows_after(path, 50)
    with CsvLogger(path, ["learner_steps", "return"], flush_every_s=0) as log:
        for step in (100, 150):
            log.write({"learner_steps": step, "return": 123.25})
    assert [(r["learner_steps"], r["return"]) for r in follower.new_rows()] == [(50, 1.0), (100, 123.25), (150, 123.25)]
    assert follower.rewritten


@pytest.mark.process
@pytest.mark.timeout(90)
def test_the_export_thread_imports_nothing_while_the_launcher_imports_reverb(tmp_path: Path) -> None:
    """The writer's modules are loaded when the export is made, on the caller's thread, and TensorFlow is not:
    an export thread importing TensorBoard while the launcher imports Reverb met half-made modules and failed."""
    code = ("import sys, pathlib; from actorq_jax.telemetry.tensorboard import TensorBoardExport; "
            f"TensorBoardExport(pathlib.Path({str(tmp_path)!r})); "
            "print(sorted(m for m in ('tensorboard.summary.writer.record_writer', 'tensorboard.compat.proto.summary_pb2',"
            " 'tensorflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['tensorboard.compat.proto.summary_pb2',", "'tensorboard.summary.writer.record_writer']"]


@pytest.mark.process
@pytest.mark.timeout(120)
def test_tensorboard_serves_the_exported_scalars(tmp_path: Path) -> None:
    """The README's `tensorboard --logdir results` finds a run's streams and tags (served on loopback only)."""
    run = RunDir(tmp_path / "results" / "q8_run")
    learner = CsvLogger(run.learner_csv, ["learner_steps", "critic_loss"], flush_every_s=0)
    learner.write({"learner_steps": 100, "critic_loss": 0.5})
    scalars = RunScalars(run.root)
    assert scalars.poll() == 1
    scalars.close()
    port = free_port()
    # TensorBoard records itself in <temp dir>/.tensorboard-info/pid-N.info and removes that file only when it exits
    # cleanly: its temp directory is the test's, so nothing of it outlives the test however it ends.
    temp = tmp_path / "temp"
    temp.mkdir()
    board = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path / "results"),
                              "--host", "127.0.0.1", "--port", str(port)], env={**ENV, "TMPDIR": str(temp)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def tags() -> dict:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as reply:
                return json.loads(reply.read())
        except OSError:
            return {}

    try:
        served = wait_for(lambda: tags().get("q8_run/tensorboard/learner"), 90, "TensorBoard's scalar tags", board)
        assert (temp / ".tensorboard-info" / f"pid-{board.pid}.info").exists()
        # Stopped as a user's Ctrl-C would. Whether TensorBoard then exits promptly is its own affair (under load
        # it has taken over a minute), so one that has not within the grace is killed, not failed.
        board.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            board.wait(timeout=15)
    finally:
        stop_all(board)
    assert "learner/critic_loss" in served
