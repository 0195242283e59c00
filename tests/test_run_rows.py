"""Under --launcher ray the learner's and evaluator's rows reach the launcher's results directory through the service.

A real Reverb server on a free loopback port stands in for the replay service.
"""

import pytest

from actorq_jax.launch.run_rows import RowSender, RunRowDrain, drop_rows_after, make_run_rows_table, row_log
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
        with row_log(node / "eval.csv", EVAL_FIELDS, forward_to=f"127.0.0.1:{port}") as evaluation:
            evaluation.write({"learner_steps": 300, "policy": "fp32", "return": 12.5, "final": 1})
        assert drain.drain() == 4
        # A learner restored to step 200 logs step 300 again: the lost timeline's row goes first.
        learner.write({"learner_steps": 300, "env_steps": 3100, "loss": 0.125})
        learner.close()
        assert drain.drain() == 1
        drain.close()
    finally:
        server.stop()
    assert [(r["learner_steps"], r["env_steps"]) for r in read_csv(results / "learner.csv")] == [
        (100, 1000), (200, 2000), (300, 3100)]
    assert read_csv(results / "eval.csv")[0]["return"] == 12.5
    assert len(read_csv(node / "learner.csv")) == 4  # the node's own copy has every row it wrote
