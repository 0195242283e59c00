"""Under --launcher ray the learner's and evaluator's rows reach the launcher's results directory through the service;
eval.csv follows the learner's surviving timeline and holds each evaluation once.

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


def _whole(log, step, policies=("fp32", "actor"), episodes=2, final=0):
    for policy in policies:
        for episode in range(episodes):
            log.write({**_evaluation(step, policy, step / 10, final), "episode": episode})


def test_a_new_evaluator_skips_the_step_the_file_holds_whole_and_makes_one_cut_short_again(tmp_path):
    path, policies = tmp_path / "eval.csv", ("fp32", "actor")
    with EvaluationLog(path, EVAL_FIELDS) as log:
        assert log.evaluated(policies, 2) is None  # nothing evaluated yet
        _whole(log, 50)
        _whole(log, 100)
    # Restarted (killed for its silence, say): step 100 is in the file whole and is not evaluated again.
    with EvaluationLog(path, EVAL_FIELDS) as log:
        assert log.evaluated(policies, 2) == 100
    assert len(read_csv(path)) == 8
    # Killed during its evaluation of step 150 (one policy's episodes written): that step is made again, whole.
    with EvaluationLog(path, EVAL_FIELDS) as log:
        log.write({**_evaluation(150, "fp32", 1.5), "episode": 0})
        log.write({**_evaluation(150, "fp32", 1.5), "episode": 1})
    with EvaluationLog(path, EVAL_FIELDS) as log:
        assert log.evaluated(policies, 2) is None and log.newest == 100
        _whole(log, 150)
    rows = read_csv(path)
    assert [(r["learner_steps"], r["policy"], r["episode"]) for r in rows if r["learner_steps"] == 150] == [
        (150, "fp32", 0), (150, "fp32", 1), (150, "actor", 0), (150, "actor", 1)]
    assert len(rows) == 12
    # A run stopped with its final evaluation at step 150, then resumed from the final checkpoint there: the
    # same weights, so not evaluated again either.
    with EvaluationLog(path, EVAL_FIELDS) as log:
        _whole(log, 150, final=1)
    with EvaluationLog(path, EVAL_FIELDS) as log:
        assert log.evaluated(policies, 2) == 150
    assert len(read_csv(path)) == 16


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_restarted_evaluator_does_not_evaluate_again_the_version_it_finds_evaluated(tmp_path):
    import threading
    import time

    import jax
    from launch_support import TINY

    from actorq_jax.environments import environment_spec, make_environment
    from actorq_jax.launch.evaluator import run_evaluator
    from actorq_jax.launch.flags import parse_run
    from actorq_jax.launch.runtime import EVAL_VARIABLES_TABLE, make_builder
    from actorq_jax.quantization import QuantConfig
    from actorq_jax.replay import ReplayServer, VariablePublisher
    from actorq_jax.replay.tables import make_variables_table

    run, agent_config = parse_run("d4pg", [*TINY, "--results_dir", str(tmp_path)])
    builder = make_builder("d4pg", agent_config, environment_spec(make_environment(run.task, seed=0)))
    params = builder.init_state(jax.random.PRNGKey(0)).policy_params
    port = free_port()
    server = ReplayServer([make_variables_table(EVAL_VARIABLES_TABLE)], port=port)
    address = f"127.0.0.1:{port}"
    try:
        import reverb

        publisher = VariablePublisher(reverb.Client(address), EVAL_VARIABLES_TABLE, QuantConfig(bits=32))
        publisher.publish(params, version=100)
        # What the evaluator before it wrote: a whole evaluation of version 100 (both policies, one episode each).
        with EvaluationLog(tmp_path / "eval.csv", EVAL_FIELDS) as log:
            _whole(log, 100, episodes=run.eval_episodes)
        stop = threading.Event()
        evaluator = threading.Thread(target=run_evaluator, args=(run, agent_config, address, stop),
                                     kwargs={"launcher_alive": lambda: False})
        evaluator.start()
        try:
            time.sleep(3.0)  # it fetches version 100 within its first poll
            publisher.publish(params, version=150)
            deadline = time.monotonic() + 60
            while not any(r["learner_steps"] == 150 for r in read_csv(tmp_path / "eval.csv")):
                assert time.monotonic() < deadline and evaluator.is_alive(), "no evaluation of version 150"
                time.sleep(0.2)
        finally:
            stop.set()
            evaluator.join(timeout=60)
    finally:
        server.stop()
    rows = read_csv(tmp_path / "eval.csv")
    at_100 = [(r["policy"], r["episode"]) for r in rows if r["learner_steps"] == 100]
    assert at_100 == [("fp32", 0), ("actor", 0)], rows  # evaluated once, by the evaluator before it
    assert {(r["policy"], r["final"]) for r in rows if r["learner_steps"] == 150} == {
        ("fp32", 0), ("actor", 0), ("fp32", 1), ("actor", 1)}


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
