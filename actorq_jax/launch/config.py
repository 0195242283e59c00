"""The run configuration shared by every agent, and config.json (written by the launcher, read by every worker)."""

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, List, Optional, Tuple

from actorq_jax.agents.registry import get_agent
from actorq_jax.config import documented
from actorq_jax.launch.runtime import LAUNCHERS, parse_cpu_list
from actorq_jax.quantization.config import GRANULARITIES, INT_BITS, VALID_BITS

BACKENDS = ("auto", "fp32", "fakequant", "int8")
INT8_MODES = ("w8a8", "w8a32")
BUDGETS = ("max_env_steps", "max_learner_steps", "max_seconds")
LAYOUTS = ("shared", "pinned")
PLATFORMS = ("auto", "cpu", "gpu")
CPU_FLAGS = ("learner_cpus", "replay_cpus", "actor_cpus")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How one ActorQ run is laid out: task, processes, precisions, budgets and logging.

    Every field is a command-line flag of the run scripts (launch/flags.py derives
    them), except those documented as not a flag.
    """

    agent: str = documented("d4pg", "registered agent (not a flag: each run script is one agent's)", flag=False)
    task: str = documented("", "dm_control 'domain_task' or a gymnasium id (default: the agent's default task)")
    results_dir: str = documented("", "results directory (default: results/<agent>_<task>_q<bits>_s<seed>_<time>)")
    seed: int = documented(0, "seed of every PRNG key in the run")
    num_actors: int = documented(2, "local actor processes (>= 1)")
    envs_per_actor: int = documented(1, "environments each actor steps in lockstep, one batched policy call per step")
    actor_bits: int = documented(8, f"precision of the actors' policy, one of {VALID_BITS} (16: half, 32: float)")
    comm_bits: Optional[int] = documented(None, "bits on the wire (default: actor_bits)")
    granularity: str = documented("per_channel", f"quantization scales, one of {GRANULARITIES}")
    actor_backend: str = documented(
        "auto", f"how actors run b-bit weights, one of {BACKENDS} (auto: the int8 kernel for <= 8 bits when built)")
    int8_mode: str = documented(
        "w8a8", f"int8 kernel activations, one of {INT8_MODES} (w8a8 actors of <= 4 bits pack weights two per byte)")
    update_period: int = documented(100, "actor env steps between variable refreshes")
    publish_period: int = documented(10, "learner steps between variable publications")
    publish_period_s: Optional[float] = documented(
        None, "seconds between variable publications (replaces publish_period when given)")
    max_env_steps: Optional[int] = documented(None, "budget: total env steps of all actors")
    max_learner_steps: Optional[int] = documented(None, "budget: learner SGD steps")
    max_seconds: Optional[float] = documented(None, "budget: wall-clock seconds")
    stop_at_return: Optional[float] = documented(
        None, "stop once an evaluation of the fp32 policy (after at least one SGD step) has a mean return at or above "
              "this; the final evaluation and checkpoint follow as at any stop")
    eval_period: int = documented(1000, "learner steps between evaluations")
    eval_episodes: int = documented(1, "greedy episodes per evaluation and policy")
    checkpoint_period: int = documented(5000, "learner steps between checkpoints")
    country: str = documented("USA", "ISO 3166 alpha-3 code for codecarbon's carbon intensity")
    actor_threads: int = documented(1, "XLA/intra-op threads per actor process")
    learner_threads: int = documented(0, "XLA threads of the learner (0: every core)")
    sgd_steps_per_call: int = documented(
        1, "SGD steps per jitted learner call (a lax.scan over that many batches: one dispatch for all of them)")
    learner_platform: str = documented(
        "auto", f"JAX platform of the learner, one of {PLATFORMS} (auto: an accelerator when JAX sees one); "
                "actors, the evaluator and the replay service always run JAX on the CPU")
    layout: str = documented(
        "shared", f"how roles share this machine's cores, one of {LAYOUTS}: shared (every role on every core) or "
                  "pinned (the learner alone on the first core, the replay service, actors and evaluator on the rest); "
                  "explicit --*_cpus flags override it")
    learner_cpus: str = documented("", "cores the learner is pinned to, e.g. 0 or 0-1 (default: from --layout)")
    replay_cpus: str = documented("", "cores the replay service is pinned to, e.g. 1 (default: from --layout)")
    actor_cpus: str = documented("", "cores actors and the evaluator are pinned to, e.g. 1 or 2,3 (default: from --layout)")
    max_actor_restarts: int = documented(3, "restarts per actor slot before the run goes on without it")
    max_learner_restarts: int = documented(
        2, "times the launcher restarts a dead learner from its last checkpoint before stopping the run")
    max_replay_restarts: int = documented(
        2, "times the launcher restarts a dead replay service from its last checkpoint (same port) before stopping the run")
    server_timeout_s: float = documented(
        60.0, "seconds a worker keeps reconnecting to an unreachable replay service before it exits non-zero; "
            "also how long a run whose own actors all died waits for an env step from a remote one")
    actor_hang_s: float = documented(
        120.0, "seconds an actor's main loop may make no progress (a call or environment that never returns) before "
               "the actor gives its id back and exits with code 6; the launcher restarts its own actors")
    port: int = documented(0, "Reverb port of the replay service (0: a free one)")
    launcher: str = documented(
        "local", f"where workers run, one of {LAUNCHERS}: local subprocesses, or Ray actors on a cluster's nodes")
    ray_address: str = documented(
        "", "Ray cluster to join with --launcher ray: 'auto' or HOST:PORT of its head "
            "(default: a Ray instance on this machine, started and stopped with the run)")
    learner_resources: str = documented(
        "", "Ray resources the learner needs, e.g. GPU=1 or CPU=2,learner_node=1 (--launcher ray)")
    replay_resources: str = documented("", "Ray resources the replay service needs, e.g. CPU=1 or replay_node=1 (--launcher ray)")
    actor_resources: str = documented("", "Ray resources each actor needs, e.g. CPU=1 or actor_node=1 (--launcher ray)")
    advertise_host: str = documented(
        "", "host part of the replay service's Reverb address other machines use (default: the loopback 127.0.0.1, "
            "as a local run's processes share one machine; under Ray its node's IP). Reverb's port has no "
            "authentication: keep a cluster on a trusted network")
    tensorboard: bool = documented(
        True, "write the run's learner, evaluator and actor rows as TensorBoard scalars under results_dir/tensorboard")
    resume: bool = documented(False, "continue from results_dir's last checkpoint (the flag is --resume RESULTS_DIR)",
                              flag=False)

    @property
    def wire_bits(self) -> int:
        """Bits on the wire (comm_bits, defaulting to actor_bits)."""
        return self.actor_bits if self.comm_bits is None else self.comm_bits

    def __post_init__(self) -> None:
        problems = run_config_problems(self)
        if problems:
            flag, message = problems[0]
            raise ValueError(f"--{flag}: {message}")


def run_config_problems(run: Any) -> List[Tuple[str, str]]:
    """(flag, message) for every invalid field of a RunConfig (or of an object with the same fields)."""
    problems = []
    for name in ("task", "results_dir"):
        if not getattr(run, name):
            problems.append((name, "must not be empty"))
    for name in ("actor_bits", "comm_bits"):
        value = getattr(run, name)
        if value is not None and value not in VALID_BITS:
            problems.append((name, f"{value} is not a supported bit-width; choose one of {VALID_BITS}"))
    for name, allowed in (("granularity", GRANULARITIES), ("actor_backend", BACKENDS), ("int8_mode", INT8_MODES)):
        if getattr(run, name) not in allowed:
            problems.append((name, f"{getattr(run, name)!r} not in {allowed}"))
    if run.actor_backend == "fp32" and run.actor_bits != 32:
        problems.append(("actor_backend", f"fp32 runs float weights; it needs --actor_bits 32, not {run.actor_bits}"))
    if run.actor_backend == "int8" and run.actor_bits not in INT_BITS:
        problems.append(("actor_backend", f"int8 needs --actor_bits in 2..8, not {run.actor_bits}"))
    if run.num_actors < 1:
        problems.append(("num_actors", f"must be >= 1, got {run.num_actors}"))
    for name in ("update_period", "publish_period", "eval_period", "eval_episodes", "checkpoint_period", "actor_threads",
                 "envs_per_actor", "sgd_steps_per_call"):
        if getattr(run, name) < 1:
            problems.append((name, f"must be >= 1, got {getattr(run, name)}"))
    for name in ("learner_threads", "max_actor_restarts", "max_learner_restarts", "max_replay_restarts"):
        if getattr(run, name) < 0:
            problems.append((name, f"must be >= 0, got {getattr(run, name)}"))
    # The seed becomes the learner's PRNG key, which keeps 32 bits without x64 (2**32 would train as seed 0).
    if not 0 <= run.seed < 2**32:
        problems.append(("seed", f"must be in 0..{2**32 - 1}, got {run.seed}"))
    if run.layout not in LAYOUTS:
        problems.append(("layout", f"{run.layout!r} not in {LAYOUTS}"))
    if run.learner_platform not in PLATFORMS:
        problems.append(("learner_platform", f"{run.learner_platform!r} not in {PLATFORMS}"))
    for name in CPU_FLAGS:
        # Only the syntax here: a remote actor reads this config on a machine with other cores.
        try:
            if getattr(run, name):
                parse_cpu_list(getattr(run, name))
        except ValueError as error:
            problems.append((name, str(error)))
    if run.launcher not in LAUNCHERS:
        problems.append(("launcher", f"{run.launcher!r} not in {LAUNCHERS}"))
    for name in ("learner_resources", "replay_resources", "actor_resources"):
        from actorq_jax.launch.ray_flags import parse_resources  # imports no Ray at module level

        try:
            parse_resources(getattr(run, name))
        except ValueError as error:
            problems.append((name, str(error)))
    if not run.server_timeout_s > 0:
        problems.append(("server_timeout_s", f"must be > 0, got {run.server_timeout_s}"))
    if not run.actor_hang_s > 0:
        problems.append(("actor_hang_s", f"must be > 0, got {run.actor_hang_s}"))
    if not 0 <= run.port < 65536:
        problems.append(("port", f"must be in 0..65535, got {run.port}"))
    if run.publish_period_s is not None and not run.publish_period_s > 0:
        problems.append(("publish_period_s", f"must be > 0, got {run.publish_period_s}"))
    for name in BUDGETS:
        value = getattr(run, name)
        if value is not None and not value > 0:
            problems.append((name, f"must be > 0, got {value}"))
    if run.stop_at_return is not None and not math.isfinite(run.stop_at_return):
        problems.append(("stop_at_return", f"must be a finite return, got {run.stop_at_return}"))
    return problems


def save_config(path: Path, run: RunConfig, agent_config: Any) -> None:
    """Writes config.json: the run config and the agent's config."""
    payload = {"run": dataclasses.asdict(run), "agent": dataclasses.asdict(agent_config)}
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True))


def config_from_json(text: str) -> Tuple[RunConfig, Any]:
    """Rebuilds (RunConfig, agent config) from config.json text; ValueError naming what is wrong."""
    try:
        payload = json.loads(text)
        run_fields, agent_fields = dict(payload["run"]), dict(payload["agent"])
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"not an ActorQ config.json ({type(error).__name__}: {error})") from None
    known = {f.name for f in dataclasses.fields(RunConfig)}
    run = RunConfig(**{k: v for k, v in run_fields.items() if k in known})
    agent_cls = get_agent(run.agent).config_class
    fields = {f.name for f in dataclasses.fields(agent_cls)}
    # JSON has no tuples: layer lists come back as lists.
    agent_kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in agent_fields.items() if k in fields}
    return run, agent_cls(**agent_kwargs)
