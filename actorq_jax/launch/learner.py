"""The learner process: a client of the replay service that trains, publishes variables and checkpoints.

The run's Reverb server lives in the replay service (launch/replay_service.py),
so a learner that dies takes no replay with it: the launcher restarts it from its
last checkpoint (state and counters) and it goes on sampling the same live table.
A checkpoint is a pair: the service writes the tables as `step_N` on the
learner's request, then the learner saves its state of step N naming that replay
checkpoint, so a service restarted from it (or a `--resume` of the whole run)
restores a replay buffer that matches the learner's state. SGD goes on while the
service writes (tens of seconds for a large table); the final checkpoint waits.

Every call to the service is bounded: a service that stops answering (killed and
being restarted on the same port) is waited for, up to `server_timeout_s`, and
the learner then carries on where it was; past that it exits non-zero.
"""

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional

import jax
import reverb

from actorq_jax.environments import environment_spec, make_environment
from actorq_jax.launch import runtime
from actorq_jax.launch.channel import RunChannel, make_channel
from actorq_jax.launch.checkpoint import Checkpointer, CheckpointUnreadable, finished_steps
from actorq_jax.launch.config import RunConfig
from actorq_jax.launch.replay_service import CHECKPOINT_S_PER_ITEM, ServiceClient, ServiceError, checkpoint_request
from actorq_jax.launch.run_rows import drop_rows_after, row_log
from actorq_jax.quantization import QuantConfig
from actorq_jax.replay import VariablePublisher
from actorq_jax.replay.background import BackgroundPublisher, PublishTotals
from actorq_jax.replay.server import StopRequested, wait_for_server
from actorq_jax.run_dir import RunDir

log = logging.getLogger(__name__)

LOG_EVERY_STEPS = 100
# How long the dataset waits on the rate limiter before the loop rechecks its stop flag.
SAMPLE_TIMEOUT_MS = 1000
# How long the final hand-over waits for the background publisher to send the last version.
FINAL_PUBLISH_TIMEOUT_S = 120.0
REPORT_EVERY_S = 1.0
# The silence a learner asks the launcher to allow between two reports, beyond what its waits are bounded by:
# the first SGD call compiles the step (a minute for large networks on a busy CPU), and a margin for the rest.
FIRST_CALL_S = 300.0
QUIET_MARGIN_S = 15.0
SERVICE_START_TIMEOUT_S = 300.0
# How often SGD looks for the reply to a checkpoint the service is writing (a look is one server_info call),
# and how often a learner that waits for it does.
CHECKPOINT_POLL_S = 0.5
CHECKPOINT_WAIT_POLL_S = 0.05
# What a call to a replay service that went away raises (the dataset's TensorFlow errors included).
SERVICE_ERRORS = (reverb.DeadlineExceededError, RuntimeError, ConnectionError, ServiceError)


class ServiceGone(RuntimeError):
    """The replay service stayed unreachable for longer than the learner's server timeout."""


class Diverged(RuntimeError):
    """A loss or a parameter of the learner is no longer finite."""


class PendingCheckpoint(NamedTuple):
    """A learner checkpoint of step `steps`, saved once the service has written its replay checkpoint."""

    request_id: str
    steps: int
    state: Any
    counters: Dict[str, Any]
    deadline: float  # time.monotonic() past which it is given up
    incarnation: Optional[str]  # of the service asked (None: not known); a restarted one never answers


class Learner:
    """Pulls batches from replay, applies the agent's pure `sgd_step`, publishes and checkpoints."""

    def __init__(self, builder: Any, run: RunConfig, results_dir: Path, address: str, stop: Optional[Any] = None):
        self.builder = builder
        self.run = run
        self.address = address
        self._stop = stop
        self.replay_table = builder.replay_config().name
        # One compiled program instead of one per primitive: eager flax init compiles dozens of tiny ops, seconds
        # on the path to the actors' first parameters. The state is the same bit for bit (a test says so).
        self.state = jax.jit(builder.init_state)(jax.random.PRNGKey(run.seed))
        self.checkpointer = Checkpointer(RunDir(results_dir).checkpoints)
        counters: Dict[str, Any] = {}
        if run.resume:
            restored = self.checkpointer.restore(self.state)
            if restored is not None:
                self.state, counters = restored
        # The launcher may start the learner beside a service that is still starting: wait as for a start, but
        # not past a stop request (a service that never came up is why the run is stopping).
        log.info("waiting for the replay service at %s", address)
        self.client = wait_for_server(address, max(run.server_timeout_s, SERVICE_START_TIMEOUT_S), stop=stop)
        self.service = ServiceClient(self.client, run.server_timeout_s)
        # The service's status reports: which incarnation of it answers on the address now.
        self._service_status = make_channel(run, results_dir, address)
        # What the learner writes back to replay after each step (None: nothing, uniform replay); it goes on
        # from the checkpoint, and tells actors through the variables' meta where new items enter.
        self.feedback = builder.priority_feedback()
        if self.feedback is not None:
            self.feedback.restore(counters)
        wire = QuantConfig(bits=run.wire_bits, granularity=run.granularity)
        # Quantize, serialize and insert run off the SGD path (the actors' table, then the evaluator's).
        self.publisher = BackgroundPublisher([
            VariablePublisher(self.client, runtime.VARIABLES_TABLE, wire),
            VariablePublisher(self.client, runtime.EVAL_VARIABLES_TABLE, QuantConfig(bits=32)),
        ])
        self.last_publish = time.monotonic()
        self._dataset: Optional[Any] = None
        self._multi_step = None
        self._batches: List[Any] = []  # batches of the next multi-step call sampled so far
        if run.sgd_steps_per_call > 1:
            from actorq_jax.agents.multi_step import multi_sgd_step

            self._multi_step = multi_sgd_step(builder.sgd_step, run.sgd_steps_per_call)
        self._pending: Optional[PendingCheckpoint] = None  # a checkpoint whose replay half is being written
        self._last_poll = 0.0
        self._env_steps_cache = (0.0, int(counters.get("env_steps", 0)))
        self._replay_items = 0  # the table's size when env steps were last counted
        # The count goes on from what was counted before, also when the service restarted from an older
        # replay checkpoint (its insert count went back; the env steps were taken all the same).
        self._last_inserts = self._inserts()
        self._env_steps_offset = max(0, int(counters.get("env_steps", 0)) - self._last_inserts)
        self.restored = {"checkpoint": counters.get("replay_checkpoint"), "items": self.items(),
                         "learner_steps": self.steps, "env_steps": int(counters.get("env_steps", 0)),
                         "unreadable": self.checkpointer.unreadable}

    @property
    def steps(self) -> int:
        """SGD steps taken so far (continues across resumes)."""
        return int(self.state.steps)

    def items(self) -> int:
        """Items in the replay table now."""
        return int(self.client.server_info(timeout=30)[self.replay_table].current_size)

    def env_steps(self, max_age_s: float = 0.5) -> int:
        """Env steps of the run: transitions inserted into replay (one per actor env step), counted by the service's
        table, never going back (steps lost with a restarted service still count)."""
        now = time.monotonic()
        if now - self._env_steps_cache[0] > max_age_s:
            try:
                info = self.client.server_info(timeout=5)[self.replay_table]
            except SERVICE_ERRORS as error:
                # A starved or restarting service: the last count is a fine answer for a report.
                log.warning("replay server_info failed (%s); reporting the last env-step count", error)
                return self._env_steps_cache[1]
            inserts = int(info.rate_limiter_info.insert_stats.completed)
            if inserts < self._last_inserts:  # the service restarted from a checkpoint's (smaller) count
                self._env_steps_offset += self._last_inserts - inserts
            self._last_inserts = inserts
            self._env_steps_cache = (now, inserts + self._env_steps_offset)
            self._replay_items = int(info.current_size)
        return self._env_steps_cache[1]

    @property
    def replay_items(self) -> int:
        """Items in the replay table when env steps were last counted: the pool batches are drawn from."""
        return self._replay_items

    def _inserts(self) -> int:
        return int(self.client.server_info(timeout=30)[self.replay_table].rate_limiter_info.insert_stats.completed)

    def wait_for_service(self) -> None:
        """Waits for a service that stopped answering to come back; ServiceGone past the server timeout."""
        self._dataset = None  # its stream went with the old server
        try:
            wait_for_server(self.address, self.run.server_timeout_s, stop=self._stop)
        except StopRequested:
            log.info("stop requested while the replay service at %s was away; stopping at step %d", self.address,
                     self.steps)
            return  # the main loop sees the stop; the hand-over keeps what it can without the service
        except TimeoutError as error:
            raise ServiceGone(f"replay service at {self.address} unreachable for {self.run.server_timeout_s:g} s "
                              f"(server_timeout_s); the learner stops at step {self.steps}") from error
        log.info("replay service at %s answers again; going on at step %d", self.address, self.steps)

    def publish(self, evaluation: bool = False) -> None:
        """Hands the actors' parameters (and, for evaluation, the float policy) to the background publisher."""
        self.last_publish = time.monotonic()
        # JAX arrays are immutable, so the publisher thread may read them while SGD goes on.
        self.publisher.submit(self.builder.actor_params(self.state), self.steps, evaluation=evaluation,
                              meta=self.feedback.meta() if self.feedback is not None else None)

    def publish_due(self) -> bool:
        """Whether the publication period (in SGD steps, or seconds with publish_period_s) has come round."""
        if self.run.publish_period_s is not None:
            return time.monotonic() - self.last_publish >= self.run.publish_period_s
        return crossed(self.steps - self.last_call_steps, self.steps, self.run.publish_period)

    @property
    def last_call_steps(self) -> int:
        """SGD steps the last call made (1, or sgd_steps_per_call)."""
        return self.run.sgd_steps_per_call if self._multi_step is not None else 1

    def non_finite(self, metrics: Optional[Dict[str, Any]] = None) -> Optional[str]:
        """What is not finite in the last call's metrics or the learner state (None when all is)."""
        from actorq_jax.finite import first_non_finite

        return first_non_finite(metrics or {}) or first_non_finite(self.state, "state ")

    def checkpoint(self, wait: bool = True) -> bool:
        """Has the service checkpoint replay and saves state and counters naming it once the service has written
        it; whether it was saved (with `wait` false: False while the service is still writing, see
        finish_checkpoint)."""
        # One at a time: an earlier checkpoint still being written is finished (or given up) first.
        self.finish_checkpoint(wait=True)
        if self.checkpointer.has(self.steps):
            return True
        name = f"step_{self.steps}"
        # The state and counters of this step: SGD may go on while the service writes replay (JAX arrays
        # are immutable, so holding the state costs nothing).
        counters = {"env_steps": self.env_steps(max_age_s=0.0), "learner_steps": self.steps,
                    "replay_checkpoint": name, **(self.feedback.counters() if self.feedback is not None else {})}
        try:
            # The service keeps the replay checkpoints of the states still kept, and this new one. The table holds
            # at most every transition so far, or its capacity: the wait allows for writing that many.
            items = min(counters["env_steps"], int(self.builder.replay_config().max_size))
            keep = [c.get("replay_checkpoint") for c in self.checkpointer.kept_counters()]
            incarnation = self.service_incarnation()
            request_id = self.service.send(checkpoint_request(name, keep))
        except SERVICE_ERRORS as error:
            log.warning("no checkpoint at step %d: the replay service could not write one (%s)", self.steps, error)
            return False
        self._pending = PendingCheckpoint(request_id, self.steps, self.state, counters,
                                          time.monotonic() + self.service.checkpoint_timeout_s(items), incarnation)
        return self.finish_checkpoint(wait=wait)

    def service_incarnation(self) -> Optional[str]:
        """The incarnation the replay service reports (None before its first report)."""
        return self._service_status.read("replay").get("incarnation")

    @property
    def checkpoint_pending(self) -> bool:
        """Whether a checkpoint waits for the service to finish writing its replay half."""
        return self._pending is not None

    def finish_checkpoint(self, wait: bool) -> bool:
        """Saves the pending checkpoint once the service has written its replay checkpoint; whether one was saved.

        Without `wait` it looks at most every CHECKPOINT_POLL_S and returns at once: a large table takes tens of
        seconds to write, which the learner spends on SGD rather than waiting.
        """
        pending = self._pending
        if pending is None:
            return False
        if not wait and time.monotonic() - self._last_poll < CHECKPOINT_POLL_S:
            return False
        while True:
            self._last_poll = time.monotonic()
            try:
                reply = self.service.poll(pending.request_id, "checkpoint")
            except SERVICE_ERRORS as error:
                log.warning("no checkpoint at step %d: the replay service could not write one (%s)", pending.steps,
                            error)
                self._pending = None
                return False
            if reply is not None:
                break
            if pending.incarnation is not None and self.service_incarnation() not in (None, pending.incarnation):
                # A service restarted from its last checkpoint starts with no requests: waiting out the deadline
                # would stall SGD (and, under a rate limiter, the actors) for nothing.
                log.warning("no checkpoint at step %d: the replay service restarted before writing it; the next "
                            "checkpoint period makes one", pending.steps)
                self._pending = None
                return False
            if time.monotonic() >= pending.deadline:
                log.warning("no checkpoint at step %d: the replay service did not write one in time", pending.steps)
                self._pending = None
                return False
            if not wait:
                return False
            time.sleep(CHECKPOINT_WAIT_POLL_S)
        self._pending = None
        self.checkpointer.save(pending.steps, pending.state, pending.counters)
        return True

    def step(self) -> Optional[Dict[str, Any]]:
        """One SGD call (sgd_steps_per_call steps) on fresh batches; None when replay could not serve them in time."""
        try:
            while len(self._batches) < self.last_call_steps:
                batch = self._next_batch()
                if batch is None:
                    return None  # the batches sampled so far wait for the next call
                self._batches.append(batch)
        except SERVICE_ERRORS as error:
            log.warning("sampling from the replay service failed: %s", error)
            self.wait_for_service()
            return None
        if self._multi_step is None:
            batch = self._batches[0]
            self.state, metrics = self.builder.sgd_step(self.state, batch)
        else:
            from actorq_jax.agents.multi_step import last_step_metrics, stack_batches

            batch = stack_batches(self._batches)
            self.state, metrics = self._multi_step(self.state, batch)
        self._batches = []
        if self.feedback is not None:
            try:
                self.feedback.write_back(self.client, batch, metrics)
            except SERVICE_ERRORS as error:
                # Those items went with a service that restarted from its checkpoint.
                log.warning("write-back to replay lost: %s", error)
        return metrics if self._multi_step is None else last_step_metrics(metrics)

    def _next_batch(self) -> Any:
        """The next batch, or None when the rate limiter held the sampler past SAMPLE_TIMEOUT_MS."""
        import tensorflow as tf

        if self._dataset is None:
            self._dataset = self.builder.make_dataset(self.address, rate_limiter_timeout_ms=SAMPLE_TIMEOUT_MS)
        try:
            return next(self._dataset)
        except StopIteration:
            # The rate limiter held us back for a while: rebuild the iterator, let the caller check stop.
            self._dataset = None
            return None
        except tf.errors.OpError as error:
            raise ConnectionError(f"replay dataset: {error.message}") from None



class LearnerLog:
    """learner.csv: one row every LOG_EVERY_STEPS steps (losses, rates, the background publisher's cost), flushed at once."""

    def __init__(self, path: Path, start: float, first_step: int, forward_to: Optional[str] = None):
        self.path = path
        self.forward_to = forward_to  # under Ray: the service that carries the rows to the launcher's process
        self.start = start
        self._logger: Any = None
        self._last = (time.monotonic(), first_step, time.process_time())
        self._last_totals = PublishTotals(0, 0, 0, 0.0, -1, 0)

    def write(self, steps: int, env_steps: int, metrics: Dict[str, float], totals: PublishTotals,
              replay_items: int) -> None:
        """Writes the row of learner step `steps` (`metrics`: the agent's loggable ones)."""
        now = time.monotonic()
        row = dict(metrics)
        if self._logger is None:
            fields = ["learner_steps", "wall_seconds", "env_steps", "sgd_steps_per_s", "cpu_s_per_step", "publish_s",
                      "publish_bytes", "versions_published", "versions_dropped", "replay_items"]
            # One row per LOG_EVERY_STEPS steps is rare enough to flush each: a SIGKILL loses none.
            self._logger = row_log(self.path, fields + sorted(row), self.forward_to, flush_every_s=0)
        last_time, last_steps, last_cpu = self._last
        cpu = time.process_time()
        row.update(
            learner_steps=steps,
            wall_seconds=round(now - self.start, 3),
            env_steps=env_steps,
            sgd_steps_per_s=(steps - last_steps) / max(now - last_time, 1e-9),
            # The process's CPU per step (XLA's compute threads, sampling and publishing included): 1 / sgd_steps_per_s
            # far above it means the learner waited (for replay, or for a core it shares), not that its step got slower.
            cpu_s_per_step=(cpu - last_cpu) / max(steps - last_steps, 1),
            # Per publication since the last row (off the SGD path: this is the publisher thread's time).
            publish_s=_per_item(totals.publish_s - self._last_totals.publish_s, totals.published - self._last_totals.published),
            publish_bytes=_per_item(totals.nbytes - self._last_totals.nbytes, totals.published - self._last_totals.published),
            versions_published=totals.published,  # cumulative since this learner process started
            versions_dropped=totals.dropped,  # replaced by a newer version before they were sent
            # Where items leave after --max_times_sampled samples, a learner as fast as the actors keeps the table
            # near --min_replay_size: this says how many transitions the batches came from.
            replay_items=replay_items,
        )
        self._logger.write(row)
        self._last = (now, steps, cpu)
        self._last_totals = totals

    def close(self) -> None:
        """Flushes the rows."""
        if self._logger is not None:
            self._logger.close()


def _per_item(total: float, count: int) -> float:
    return total / count if count > 0 else 0.0


def run_learner(run: RunConfig, agent_config: Any, address: str, stop: threading.Event) -> int:
    """Learner main loop against the replay service at `address` until `stop` or a learner-step budget; the exit
    code (runtime.EXIT_DIVERGED when a loss or parameter stopped being finite)."""
    results_dir = RunDir(run.results_dir)
    spec = environment_spec(make_environment(run.task, seed=run.seed))
    try:
        learner = Learner(runtime.make_builder(run.agent, agent_config, spec), run, results_dir.root, address, stop)
    except StopRequested:
        # Nothing was learned, published or checkpointed yet: there is nothing to hand over.
        log.info("stop requested before the replay service at %s answered; no step taken", address)
        return 0
    except CheckpointUnreadable as error:
        # The run's files, not a fault of this process: its message without a traceback, and no restart can help.
        log.error("%s", error)
        return 2
    drop_rows_after(results_dir.learner_csv, learner.steps)
    start = time.monotonic()
    csv_log = LearnerLog(results_dir.learner_csv, start, learner.steps,
                         forward_to=address if run.launcher == "ray" else None)
    learner.publish(evaluation=True)
    report = StatusReport(learner, start, make_channel(run, results_dir.root, address))
    report("running")
    try:
        try:
            while not stop.is_set() and not (run.max_learner_steps is not None
                                             and learner.steps >= run.max_learner_steps):
                metrics = learner.step()
                if metrics is not None:
                    report.compiled = True
                    _after_step(learner, csv_log, metrics)
                report.maybe("running")
        except Diverged:
            raise
        except BaseException:
            _hand_over(learner, csv_log, report)  # whatever stopped the loop, keep what can be kept
            raise
        problem = learner.non_finite()  # the final checkpoint is checked like every other
        if problem:
            raise Diverged(problem)
    except Diverged as error:
        learner.finish_checkpoint(wait=True)  # a checkpoint being written was checked finite when it was asked for
        last = learner.checkpointer.latest_step()
        message = (f"learner diverged at step {learner.steps}: {error}; "
                   + (f"last finite checkpoint at step {last}" if last is not None else "no checkpoint was written"))
        log.error("%s", message)
        # Nothing more is published or checkpointed: the run's last checkpoint stays the last finite one.
        learner.publisher.close(timeout_s=0.0)
        learner.checkpointer.close()
        csv_log.close()
        report("diverged", message=message)
        return runtime.EXIT_DIVERGED
    _hand_over(learner, csv_log, report)
    return 0


def crossed(before: int, after: int, period: int) -> bool:
    """Whether a multiple of `period` lies in (before, after]: a call of several steps may step over it."""
    return after // period > before // period


def _after_step(learner: Learner, csv_log: LearnerLog, metrics: Dict[str, Any]) -> None:
    """What the periods ask for after the call that ended at SGD step `learner.steps`: publish, evaluate,
    checkpoint, log."""
    run, steps = learner.run, learner.steps
    before = steps - learner.last_call_steps
    evaluation = crossed(before, steps, run.eval_period)
    publish = learner.publish_due() or evaluation
    log_row = crossed(before, steps, LOG_EVERY_STEPS)
    checkpoint = crossed(before, steps, run.checkpoint_period)
    # Checked whenever something would leave the learner: nothing non-finite is published, logged as a
    # good row, or checkpointed (one small jitted reduction per publication, against an SGD step's cost).
    if publish or log_row or checkpoint:
        problem = learner.non_finite(metrics)
        if problem:
            raise Diverged(problem)
    if publish:
        learner.publish(evaluation=evaluation)
    # The row before the checkpoint: a checkpoint at step N then implies row N is on disk, so a learner
    # killed right after it (and restored to it) never loses the rows its checkpoint accounts for.
    if log_row:
        csv_log.write(steps, learner.env_steps(), learner.builder.loggable_metrics(metrics), learner.publisher.totals(),
                      learner.replay_items)
    if checkpoint:
        learner.checkpoint(wait=False)
    elif learner.checkpoint_pending:
        learner.finish_checkpoint(wait=False)


class StatusReport:
    """Reports the learner's phase, counters, restore and finished checkpoints to the launcher (its channel)."""

    def __init__(self, learner: Learner, start: float, channel: RunChannel):
        self.learner = learner
        self.start = start
        self.channel = channel
        self.last = 0.0
        self.beats = 0
        self.compiled = False  # whether an SGD call ran (the first one compiles the step)

    def quiet_s(self, env_steps: int) -> float:
        """The longest the learner may stay silent after this report: each wait of a loop pass is bounded."""
        run = self.learner.run
        items = min(env_steps, int(self.learner.builder.replay_config().max_size))
        # The service away (wait_for_service), then an earlier checkpoint's reply, then every batch of a call.
        quiet = (2 * run.server_timeout_s + CHECKPOINT_S_PER_ITEM * items
                 + run.sgd_steps_per_call * SAMPLE_TIMEOUT_MS / 1000 + QUIET_MARGIN_S)
        return quiet + (0.0 if self.compiled else FIRST_CALL_S)

    def __call__(self, phase: str, more_quiet_s: float = 0.0, **extra: Any) -> None:
        learner = self.learner
        env_steps = learner.env_steps()
        self.beats += 1
        self.channel.report("learner", {
            **extra,
            "phase": phase,
            "beat": self.beats,  # the launcher tells a live learner from a stopped or hung one by it
            "quiet_s": self.quiet_s(env_steps) + more_quiet_s,
            "pid": os.getpid(),
            "address": learner.address,  # the replay service it samples
            "platform": jax.default_backend(),
            "learner_steps": learner.steps,
            "env_steps": env_steps,
            "replay_items": learner.replay_items,  # the pool its batches come from (the launcher's progress line)
            "wall_seconds": time.monotonic() - self.start,
            "restored": learner.restored,
            # Finished checkpoints on this node (under Ray the launcher's process copies each new one).
            "checkpoints": finished_steps(learner.checkpointer.directory),
        })
        self.last = time.monotonic()

    def maybe(self, phase: str) -> bool:
        """Reports when the last report is older than REPORT_EVERY_S; whether it did."""
        if time.monotonic() - self.last > REPORT_EVERY_S:
            self(phase)
            return True
        return False


def _hand_over(learner: Learner, csv_log: LearnerLog, report: StatusReport) -> None:
    """Final publication for the evaluator, a last checkpoint (replay included), flushed logs."""
    report("stopping", more_quiet_s=FINAL_PUBLISH_TIMEOUT_S)
    learner.publish(evaluation=True)
    if not learner.publisher.close(FINAL_PUBLISH_TIMEOUT_S):
        log.warning("the final version was not published within %.0f s", FINAL_PUBLISH_TIMEOUT_S)
    learner.checkpoint()
    learner.checkpointer.close()
    csv_log.close()
    report("done")
