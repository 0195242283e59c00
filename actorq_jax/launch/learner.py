"""The learner process: owns the Reverb server, trains, publishes variables, checkpoints."""

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

import jax
import numpy as np
import reverb

from actorq_jax.environments import environment_spec, make_environment
from actorq_jax.launch import runtime
from actorq_jax.launch.checkpoint import Checkpointer
from actorq_jax.launch.config import RunConfig
from actorq_jax.quantization import QuantConfig
from actorq_jax.replay import (
    ReplayDataset,
    ReplayServer,
    VariablePublisher,
    update_priorities,
)
from actorq_jax.telemetry import CsvLogger, write_json

log = logging.getLogger(__name__)

LOG_EVERY_STEPS = 100
# How long the dataset waits on the rate limiter before the loop rechecks its stop flag.
SAMPLE_TIMEOUT_MS = 1000
EVALUATOR_GRACE_S = 300.0


class Learner:
    """Pulls batches from replay, applies the agent's pure `sgd_step`, publishes and checkpoints."""

    def __init__(self, builder: Any, run: RunConfig, server: ReplayServer, results_dir: Path):
        self.builder = builder
        self.run = run
        self.server = server
        self.results_dir = results_dir
        self.client = server.client()
        self.replay_table = builder.replay_config().name
        self.state = builder.init_state(jax.random.PRNGKey(run.seed))
        self.checkpointer = Checkpointer(results_dir / "checkpoints")
        self.env_steps_offset = 0
        if run.resume:
            restored = self.checkpointer.restore(self.state)
            if restored is not None:
                self.state, counters = restored
                # Replay starts empty after a resume; env steps carry on from the checkpoint.
                self.env_steps_offset = int(counters.get("env_steps", 0))
        wire = QuantConfig(bits=run.wire_bits, granularity=run.granularity)
        self.publisher = VariablePublisher(self.client, runtime.VARIABLES_TABLE, wire)
        self.eval_publisher = VariablePublisher(self.client, runtime.EVAL_VARIABLES_TABLE, QuantConfig(bits=32))
        self._dataset: Optional[ReplayDataset] = None
        self._env_steps_cache = (0.0, self.env_steps_offset)

    @property
    def steps(self) -> int:
        """SGD steps taken so far (continues across resumes)."""
        return int(self.state.steps)

    def env_steps(self) -> int:
        """Transitions inserted into replay (one per actor env step), counted by the server."""
        now = time.monotonic()
        if now - self._env_steps_cache[0] > 0.5:
            try:
                info = self.client.server_info(timeout=5)[self.replay_table]
            except reverb.DeadlineExceededError:
                # A starved machine can miss the deadline; the last count is a fine answer for a report.
                log.warning("replay server_info timed out; reporting the last env-step count")
                return self._env_steps_cache[1]
            inserted = int(info.rate_limiter_info.insert_stats.completed)
            self._env_steps_cache = (now, self.env_steps_offset + inserted)
        return self._env_steps_cache[1]

    def publish(self, evaluation: bool = False) -> None:
        """Sends the actors' parameters (and, for evaluation, the float policy) to the server."""
        params = jax.device_get(self.builder.actor_params(self.state))
        self.publisher.publish(params, self.steps)
        if evaluation:
            self.eval_publisher.publish(params, self.steps)

    def checkpoint(self) -> None:
        """Saves state and counters."""
        self.checkpointer.save(self.steps, self.state, {"env_steps": self.env_steps(), "learner_steps": self.steps})

    def step(self) -> Optional[Dict[str, Any]]:
        """One SGD step on a fresh batch; None when replay could not serve one in time."""
        if self._dataset is None:
            self._dataset = ReplayDataset(
                self.server.address,
                self.replay_table,
                self.builder.config.batch_size,
                with_info=True,  # the agent contract's sgd_step takes a ReplayBatch
                rate_limiter_timeout_ms=SAMPLE_TIMEOUT_MS,
            )
        try:
            batch = next(self._dataset)
        except StopIteration:
            # The rate limiter held us back for a while: rebuild the iterator, let the caller check stop.
            self._dataset = None
            return None
        self.state, metrics = self.builder.sgd_step(self.state, batch)
        update = self.builder.priority_update(batch, metrics)
        if update is not None:
            update_priorities(self.client, self.replay_table, update.keys, update.priorities)
        return metrics


def run_learner(run: RunConfig, agent_config: Any, config_json: str, stop: threading.Event) -> None:
    """Learner main loop until `stop` or a learner-step budget; then final checkpoint and hand-over."""
    results_dir = Path(run.results_dir)
    env = make_environment(run.task, seed=run.seed)
    spec = environment_spec(env)
    builder = runtime.make_builder(run.agent, agent_config, spec)
    server = ReplayServer(runtime.learner_tables(builder), port=run.port or None, advertised_host=socket.getfqdn())
    learner = Learner(builder, run, server, results_dir)
    client = learner.client
    runtime.publish_config(client, config_json)
    learner.publish(evaluation=True)
    start = time.monotonic()
    status_path = runtime.status_file(results_dir, "learner")

    def report(phase: str) -> None:
        write_json(status_path, {
            "phase": phase,
            "address": server.address,
            "local_address": f"localhost:{server.port}",
            "learner_steps": learner.steps,
            "env_steps": learner.env_steps(),
            "wall_seconds": time.monotonic() - start,
        })

    report("running")
    logger: Optional[CsvLogger] = None
    last_report = last_log_time = time.monotonic()
    steps_at_last_log = learner.steps
    try:
        while not stop.is_set():
            if run.max_learner_steps is not None and learner.steps >= run.max_learner_steps:
                break
            metrics = learner.step()
            now = time.monotonic()
            if metrics is not None:
                steps = learner.steps
                if steps % run.publish_period == 0:
                    learner.publish(evaluation=steps % run.eval_period == 0)
                elif steps % run.eval_period == 0:
                    learner.publish(evaluation=True)
                if steps % run.checkpoint_period == 0:
                    learner.checkpoint()
                if steps % LOG_EVERY_STEPS == 0:
                    row = {k: float(np.mean(v)) for k, v in jax.device_get(metrics).items() if k != "priorities"}
                    if logger is None:
                        fields = ["learner_steps", "wall_seconds", "env_steps", "sgd_steps_per_s"] + sorted(row)
                        logger = CsvLogger(results_dir / "learner.csv", fields)
                    row.update(
                        learner_steps=steps,
                        wall_seconds=round(now - start, 3),
                        env_steps=learner.env_steps(),
                        sgd_steps_per_s=(steps - steps_at_last_log) / max(now - last_log_time, 1e-9),
                    )
                    logger.write(row)
                    last_log_time, steps_at_last_log = now, steps
            if now - last_report > 1.0:
                report("running")
                last_report = now
    finally:
        # Final hand-over: the last float policy for the evaluator, a checkpoint, flushed logs.
        learner.publish(evaluation=True)
        learner.checkpoint()
        learner.checkpointer.close()
        if logger is not None:
            logger.close()
        report("final")
        # Keep the server up until the launcher says the evaluator has fetched the final policy.
        release = runtime.status_file(results_dir, "learner.release")
        deadline = time.monotonic() + EVALUATOR_GRACE_S
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        report("done")  # before the server goes: the report reads its insert count
        server.stop()
