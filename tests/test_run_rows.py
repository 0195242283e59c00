"""Under --launcher ray the learner's and evaluator's rows reach the launcher's results directory through the service.

A real Reverb server on a free loopback port stands in for the replay service.
"""

import pytest

from actorq_jax.launch.run_rows import (
    EvaluationLog,
    RowSender,
    RunRowDrain,
    drop_rows_after,
    make_run_rows_table,
    row_log,
)
from actorq_jax.launch.runtime import free_port
from actorq_jax.telemetry import EVAL_FIELDS, CsvLogger, read_csv

FIELDS = ["learner_steps", "env_steps", "loss"]


def test_rows_past_a_step_are_dropped(tmp_path):
    path = tmp_path / "learner.csv"
    with CsvLogger(path, FIELDS, flush_every_s=0) as log:
        for step in (100, 200, 300):
            log.write({"learner_steps": step, "env_steps": step * 10, "loss": 0.5})
    drop_rows_after(path, 200)
    assert [r["learner_steps"] for r in read_csv(path)] == [100, 200]


def _evaluation(step, policy, episode_return, final=0):
    return {"learner_steps": step, "policy": policy, "return": episode_return, "final": final}


def test_an_evaluation_behind_the_newest_drops_the_lost_timelines_evaluations_first(tmp_path):
    path = tmp_path / "eval.csv"
    with EvaluationLog(path, EVAL_FIELDS) as log:
        for step in (50, 100, 150):
            for policy in ("fp32", "actor"):
                log.write(_evaluation(step, policy, step / 10))
        # The learner, restored from its checkpoint at step 100, publishes step 100 again, then goes on.
        log.write(_evaluation(100, "fp32", 9.9))
        log.write(_evaluation(100, "actor", 9.8))
        log.write(_evaluation(150, "fp32", 1.5))
        # The final evaluation repeats the newest step: nothing goes.
        log.write(_evaluation(150, "fp32", 1.6, final=1))
    assert [(r["learner_steps"], r["policy"], r["return"]) for r in read_csv(path)] == [
        (50, "fp32", 5.0), (50, "actor", 5.0), (100, "fp32", 9.9), (100, "actor", 9.8), (150, "fp32", 1.5),
        (150, "fp32", 1.6)]
    # A new evaluator, for a --resume from the checkpoint at step 50, finds the newest step in the file.
    with EvaluationLog(path, EVAL_FIELDS) as log:
        log.write(_evaluation(50, "fp32", 7.0))
    assert [(r["learner_steps"], r["return"]) for r in read_csv(path)] == [(50, 7.0)]


def test_only_known_files_are_carried():
    with pytest.raises(ValueError, match="not carried"):
        RowSender("127.0.0.1:1", "summary.json", FIELDS)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_rows_sent_on_a_node_are_written_by_the_launcher(tmp_path):
    import reverb

    from actorq_jax.replay import ReplayServer

    port = free_port()
    server = ReplayServer([make_run_rows_table()], port=port)
    node, results = tmp_path / "node", tmp_path / "results"
    try:
        drain = RunRowDrain(reverb.Client(f"127.0.0.1:{port}"), results)
        learner = row_log(node / "learner.csv", FIELDS, forward_to=f"127.0.0.1:{port}", flush_every_s=0)
        for step in (100, 200, 300):
            learner.write({"learner_steps": step, "env_steps": step * 10, "loss": 0.25})
        evaluation = EvaluationLog(node / "eval.csv", EVAL_FIELDS, forward_to=f"127.0.0.1:{port}")
        evaluation.write(_evaluation(100, "fp32", 10.0))
        evaluation.write(_evaluation(300, "fp32", 12.5))
        evaluation.flush()
        assert drain.drain() == 5
        # A learner restored to step 200 logs step 300 again: the lost timeline's row goes first.
        learner.write({"learner_steps": 300, "env_steps": 3100, "loss": 0.125})
        learner.close()
        # Its evaluations start again at step 200: the lost timeline's evaluation at step 300 goes first.
        evaluation.write(_evaluation(200, "fp32", 11.0))
        evaluation.close()
        assert drain.drain() == 2
        drain.close()
    finally:
        server.stop()
    assert [(r["learner_steps"], r["env_steps"]) for r in read_csv(results / "learner.csv")] == [
        (100, 1000), (200, 2000), (300, 3100)]
    for evaluations in (results / "eval.csv", node / "eval.csv"):  # the launcher's copy and the node's alike
        assert [(r["learner_steps"], r["return"]) for r in read_csv(evaluations)] == [(100, 10.0), (200, 11.0)]
    assert len(read_csv(node / "learner.csv")) == 4  # the node's own copy has every row it wrote
