"""The evaluator process: greedy episodes of the float policy and of the actors' quantized policy."""

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

from actorq_jax.launch import runtime
from actorq_jax.launch.channel import RunChannel, make_channel
from actorq_jax.run_dir import RunDir

# Learner phases after which it publishes nothing more (a diverged learner stops without a last publication).
FINAL_PHASES = ("final", "done", "diverged")
# How long one fetch of the newest policy waits for it (a backstop: each fetch is two Reverb calls of at most
# 2 s, which end, failed or not, well inside FETCH_QUIET_S).
FETCH_TIMEOUT_S = 60.0
FETCH_QUIET_S = 10.0
# What an episode may take before one has been timed (its policy's first call compiles), and what a timed one may
# take against the longest so far: a run's other processes can take the evaluator's core for a while.
FIRST_EPISODE_S = 300.0
EPISODE_SLACK = 4.0
QUIET_MARGIN_S = 15.0
REPORT_EVERY_S = 1.0

log = logging.getLogger(__name__)


def run_episode(env: Any, policy: Callable[[Any, Any], Any], params: Any) -> float:
    """Return of one greedy episode."""
    import numpy as np

    timestep = env.reset()
    total = 0.0
    while not timestep.last():
        timestep = env.step(np.asarray(policy(params, timestep.observation)))
        total += float(timestep.reward)
    return total


def actors_view(run: Any) -> Callable[[Any], Any]:
    """`float payload -> what the actors run`: the payload they receive (comm_bits), through their own loader."""
    from actorq_jax.launch.precision import ActorPrecision, make_param_loader
    from actorq_jax.quantization import QuantConfig, dequantize, quantize

    precision = ActorPrecision(run.actor_bits, run.wire_bits, run.granularity, run.actor_backend, run.int8_mode)
    load = make_param_loader(precision)
    wire = QuantConfig(bits=run.wire_bits, granularity=run.granularity)
    # The learner's publisher quantizes the same float weights at the same config, and the wire is lossless.
    return lambda float_payload: load(quantize(dequantize(float_payload), wire))


class Evaluator:
    """Greedy episodes of each policy (fp32, and the actors' view at actor_bits) for each new published version."""

    def __init__(self, run: Any, agent_config: Any, address: str, stop: Optional[Any] = None):
        from actorq_jax.environments import environment_spec, make_environment
        from actorq_jax.quantization import QuantConfig, dequantize, quantized_shapes
        from actorq_jax.replay import VariableClient, wait_for_server

        self.run = run
        self.results_dir = Path(run.results_dir)
        self.env = make_environment(run.task, seed=runtime.derive_seed(run.seed, 10_000))
        builder = runtime.make_builder(run.agent, agent_config, environment_spec(self.env))
        self.greedy = builder.greedy_policy()
        self.policies = [("fp32", 32, dequantize)]
        if run.actor_bits != 32:
            self.policies.append(("actor", run.actor_bits, actors_view(run)))
        log.info("waiting for the replay service at %s", address)
        wait_for_server(address, timeout_s=60.0, stop=stop)
        # Refreshed by hand (update_period is irrelevant): the evaluator polls for new versions. A learner that
        # restarts is away for a moment: keep the last policy and go on rather than fail (errors are logged).
        self.variables = VariableClient(address, runtime.EVAL_VARIABLES_TABLE, update_period=1,
                                        like=quantized_shapes(builder.params_template(), QuantConfig(bits=32)),
                                        raise_errors=False)
        # Status reports (files locally, the replay service's tables under Ray).
        self.channel = make_channel(run, self.results_dir, address)
        # Wall time counts from the launcher's start, so eval.csv lines up with every other stream.
        self.start = float(self.channel.read("launcher").get("start_time", time.time()))
        self.last_version: Optional[int] = None

    def fetch(self) -> Optional[Tuple[Any, int]]:
        """The newest published float policy and its version (None before the first)."""
        self.variables.refresh(timeout_s=FETCH_TIMEOUT_S)
        return None if self.variables.params is None else (self.variables.params, self.variables.version)

    def evaluate(self, logger: Any, qparams: Any, version: int, final: bool,
                 beat: Callable[..., None] = lambda *a, **k: None) -> None:
        """Runs eval_episodes greedy episodes per policy and writes one row each (`beat`: after each episode)."""
        env_steps = self.channel.read("learner").get("env_steps", 0)
        for name, bits, load in self.policies:
            params = load(qparams)
            for episode in range(self.run.eval_episodes):
                started = time.monotonic()
                episode_return = run_episode(self.env, self.greedy, params)
                beat("evaluating", episode_s=(name, time.monotonic() - started))
                logger.write({
                    "wall_seconds": round(time.time() - self.start, 3), "env_steps": env_steps,
                    "learner_steps": version, "policy": name, "bits": bits, "episode": episode,
                    "return": episode_return, "final": int(final),
                })
        logger.flush()
        self.last_version = version


class Heartbeat:
    """The evaluator's reports to the launcher: a count that grows while it works, and the silence it may keep."""

    def __init__(self, channel: RunChannel, policies: Tuple[str, ...]):
        self.channel = channel
        self.untimed = set(policies)  # policies not yet through an episode (their first call compiles)
        self.longest_episode_s = 0.0
        self.beats = 0
        self.last = 0.0

    def quiet_s(self) -> float:
        """The longest the evaluator may stay silent after a report: a fetch, then an episode."""
        episode = FIRST_EPISODE_S if self.untimed else EPISODE_SLACK * self.longest_episode_s
        return FETCH_QUIET_S + episode + QUIET_MARGIN_S

    def __call__(self, phase: str, episode_s: Optional[Tuple[str, float]] = None) -> None:
        """Reports `phase`; `episode_s`: (policy, seconds) of the episode that just ended."""
        if episode_s is not None:
            self.untimed.discard(episode_s[0])
            self.longest_episode_s = max(self.longest_episode_s, episode_s[1])
        self.beats += 1
        self.channel.report("evaluator", {"phase": phase, "pid": os.getpid(), "beat": self.beats,
                                          "quiet_s": self.quiet_s()})
        self.last = time.monotonic()

    def maybe(self, phase: str) -> None:
        """Reports when the last report is older than REPORT_EVERY_S."""
        if time.monotonic() - self.last > REPORT_EVERY_S:
            self(phase)


def wait_for_final_publication(channel: RunChannel, launcher_alive: Callable[[], bool], timeout_s: float = 60.0,
                               waiting: Callable[[], None] = lambda: None) -> None:
    """Waits until the learner has made its last publication or will make none (not for a learner nobody releases)."""
    deadline = time.monotonic() + timeout_s
    while channel.read("learner").get("phase") not in FINAL_PHASES:
        if time.monotonic() > deadline or not launcher_alive() or channel.read("launcher").get("learner_ended"):
            return
        waiting()
        time.sleep(0.2)


def run_evaluator(run: Any, agent_config: Any, address: str, stop: threading.Event,
                  launcher_alive: Callable[[], bool] = lambda: True) -> None:
    """Evaluates every new float policy the learner publishes, and once more at shutdown."""
    from actorq_jax.launch.run_rows import EvaluationLog
    from actorq_jax.replay.server import StopRequested
    from actorq_jax.telemetry import EVAL_FIELDS

    try:
        evaluator = Evaluator(run, agent_config, address, stop)
    except StopRequested:
        log.info("stop requested before the replay service at %s answered; nothing evaluated", address)
        return
    # Under Ray the rows also go to the launcher's process, through the replay service.
    forward_to = address if run.launcher == "ray" else None
    # The launcher kills an evaluator that is alive but stops reporting (stopped, hung) and starts another.
    beat = Heartbeat(evaluator.channel, tuple(name for name, _, _ in evaluator.policies))
    with EvaluationLog(RunDir(evaluator.results_dir).eval_csv, EVAL_FIELDS, forward_to) as logger:
        evaluator.last_version = logger.evaluated(tuple(name for name, _, _ in evaluator.policies), run.eval_episodes)
        while True:
            final = stop.is_set()
            if not final:
                beat.maybe("waiting")
            else:
                beat("final")
                wait_for_final_publication(evaluator.channel, launcher_alive, waiting=lambda: beat.maybe("final"))
            fetched = evaluator.fetch()
            if fetched is not None and (fetched[1] != evaluator.last_version or final):
                evaluator.evaluate(logger, *fetched, final=final, beat=beat)
            if final:
                evaluator.variables.stop()
                beat("done")
                return
            stop.wait(0.5)
