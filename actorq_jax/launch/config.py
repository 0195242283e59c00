"""The run configuration shared by every agent (no JAX import: flag parsing stays cheap)."""

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

BACKENDS = ("auto", "fp32", "fakequant", "int8")
INT8_MODES = ("w8a8", "w8a32")
GRANULARITIES = ("per_channel", "per_tensor")
VALID_BITS = (2, 3, 4, 5, 6, 7, 8, 16, 32)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How one ActorQ run is laid out: task, processes, precisions, budgets and logging."""

    agent: str  # "d4pg" or "dqn"
    task: str  # dm_control "domain_task" or a gymnasium id
    results_dir: str  # where config, CSVs, checkpoints and summary go
    seed: int = 0  # one seed -> every process's PRNG keys
    num_actors: int = 2  # local actor processes
    actor_bits: int = 8  # precision of the actors' policy: 2..8 integer, 16 half, 32 float
    comm_bits: Optional[int] = None  # precision on the wire; None means actor_bits
    granularity: str = "per_channel"  # quantization scale granularity
    actor_backend: str = "auto"  # fp32 | fakequant | int8 | auto (int8 kernel when bits <= 8 and built)
    int8_mode: str = "w8a8"  # int8 kernel: w8a8 (activations quantized per row, as PyTorch's dynamic int8) or w8a32
    update_period: int = 100  # actor env steps between variable refreshes
    publish_period: int = 10  # learner steps between variable publications
    max_env_steps: Optional[int] = None  # budget: total env steps over all actors
    max_learner_steps: Optional[int] = None  # budget: SGD steps
    max_seconds: Optional[float] = None  # budget: wall-clock seconds
    eval_period: int = 1000  # learner steps between evaluations
    eval_episodes: int = 1  # greedy episodes per evaluation and policy
    checkpoint_period: int = 5000  # learner steps between checkpoints
    country: str = "USA"  # ISO code for codecarbon's carbon intensity
    actor_threads: int = 1  # XLA/intra-op threads per actor process
    learner_threads: int = 0  # 0: let XLA use every core
    max_actor_restarts: int = 3  # per actor slot, before the run gives up on it
    port: int = 0  # Reverb port of the learner; 0 picks a free one
    resume: bool = False  # continue from the results_dir's last checkpoint

    @property
    def wire_bits(self) -> int:
        """Bits on the wire (comm_bits, defaulting to actor_bits)."""
        return self.actor_bits if self.comm_bits is None else self.comm_bits

    def __post_init__(self) -> None:
        problems = validate_run_fields(dataclasses.asdict(self))
        if problems:
            flag, message = problems[0]
            raise ValueError(f"--{flag}: {message}")


def validate_run_fields(fields: Dict[str, Any]) -> list:
    """Returns (flag, message) pairs for every invalid run field."""
    problems = []
    if fields["agent"] not in ("d4pg", "dqn"):
        problems.append(("agent", f"unknown agent {fields['agent']!r}"))
    for name in ("actor_bits", "comm_bits"):
        value = fields.get(name)
        if value is not None and value not in VALID_BITS:
            problems.append((name, f"{value} is not a supported bit-width; choose one of {VALID_BITS}"))
    if fields["granularity"] not in GRANULARITIES:
        problems.append(("granularity", f"{fields['granularity']!r} not in {GRANULARITIES}"))
    if fields["actor_backend"] not in BACKENDS:
        problems.append(("actor_backend", f"{fields['actor_backend']!r} not in {BACKENDS}"))
    if fields.get("int8_mode", "w8a8") not in INT8_MODES:
        problems.append(("int8_mode", f"{fields['int8_mode']!r} not in {INT8_MODES}"))
    if fields["actor_backend"] == "fp32" and fields["actor_bits"] != 32:
        problems.append(("actor_backend", f"fp32 runs float weights; it needs --actor_bits 32, not {fields['actor_bits']}"))
    if fields["actor_backend"] == "int8" and fields["actor_bits"] > 8:
        problems.append(("actor_backend", f"int8 needs --actor_bits in 2..8, not {fields['actor_bits']}"))
    if fields["num_actors"] < 0:
        problems.append(("num_actors", f"must be >= 0, got {fields['num_actors']}"))
    positive = ("update_period", "publish_period", "eval_period", "eval_episodes", "checkpoint_period", "actor_threads")
    for name in positive:
        if fields[name] < 1:
            problems.append((name, f"must be >= 1, got {fields[name]}"))
    for name in ("max_env_steps", "max_learner_steps", "max_seconds"):
        value = fields.get(name)
        if value is not None and value <= 0:
            problems.append((name, f"must be > 0, got {value}"))
    return problems


def parse_layer_sizes(text: str) -> Tuple[int, ...]:
    """Parses a comma list such as '256,256,256' into layer sizes, raising ValueError when malformed."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"malformed layer list {text!r}: expected positive integers like 256,256")
    return tuple(int(p) for p in parts)


def save_config(path: Path, run: RunConfig, agent_config: Any) -> None:
    """Writes config.json: the run config and the agent's config."""
    payload = {"run": dataclasses.asdict(run), "agent": dataclasses.asdict(agent_config)}
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True))


def config_from_json(text: str) -> Tuple[RunConfig, Any]:
    """Rebuilds (RunConfig, agent config) from config.json text."""
    payload = json.loads(text)
    run = RunConfig(**payload["run"])
    agent_cls = agent_config_class(run.agent)
    fields = {f.name for f in dataclasses.fields(agent_cls)}
    agent_kwargs = {}
    for key, value in payload["agent"].items():
        if key in fields:
            agent_kwargs[key] = tuple(value) if isinstance(value, list) else value
    return run, agent_cls(**agent_kwargs)


def agent_config_class(agent: str) -> type:
    """The config dataclass of an agent."""
    if agent == "d4pg":
        from actorq_jax.agents.d4pg.config import D4PGConfig

        return D4PGConfig
    if agent == "dqn":
        from actorq_jax.agents.dqn.config import DQNConfig

        return DQNConfig
    raise ValueError(f"unknown agent {agent!r}; choose d4pg or dqn")
