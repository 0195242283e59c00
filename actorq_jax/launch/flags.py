"""Command-line flags shared by experiments/run_d4pg.py and experiments/run_dqn.py.

Flags are parsed only at the entry points; everything below them takes the
typed RunConfig and agent config. Invalid values exit with code 2 before any
process starts, naming the flag.
"""

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

from actorq_jax.launch.config import (
    BACKENDS,
    GRANULARITIES,
    INT8_MODES,
    VALID_BITS,
    RunConfig,
    parse_layer_sizes,
    validate_run_fields,
)

# Agent fields exposed as flags, with the flag's help. Layer lists are comma lists.
_LAYER_FLAGS = {"d4pg": ("policy_layers", "critic_layers"), "dqn": ("q_layers",)}


def _parse_layers(text: str) -> Tuple[int, ...]:
    try:
        return parse_layer_sizes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser(agent: str, agent_config_cls: type, description: str) -> argparse.ArgumentParser:
    """The parser of one agent's run script: run flags plus the agent's hyper-parameters."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = {"d4pg": "cartpole_balance", "dqn": "CartPole-v1"}
    run = parser.add_argument_group("run")
    run.add_argument("--task", default=defaults[agent], help="dm_control 'domain_task' or a gymnasium id")
    run.add_argument("--seed", type=int, default=0, help="seed of every PRNG key in the run")
    run.add_argument("--num_actors", type=int, default=2, help="local actor processes (>= 1)")
    run.add_argument("--actor_bits", type=int, default=8, help=f"actor precision, one of {VALID_BITS}")
    run.add_argument("--comm_bits", type=int, default=None, help="bits on the wire (default: actor_bits)")
    run.add_argument("--granularity", default="per_channel", help=f"quantization scales: {GRANULARITIES}")
    run.add_argument("--actor_backend", default="auto", help=f"how actors run b-bit weights: {BACKENDS}")
    run.add_argument("--int8_mode", default="w8a8",
                     help=f"int8 kernel activations: {INT8_MODES} (w8a8 actors of <= 4 bits pack weights two per byte)")
    run.add_argument("--update_period", type=int, default=100, help="actor env steps between variable refreshes")
    run.add_argument("--publish_period", type=int, default=10, help="learner steps between variable publications")
    run.add_argument("--max_env_steps", type=int, default=None, help="budget: total env steps of all actors")
    run.add_argument("--max_learner_steps", type=int, default=None, help="budget: learner SGD steps")
    run.add_argument("--max_seconds", type=float, default=None, help="budget: wall-clock seconds")
    run.add_argument("--eval_period", type=int, default=1000, help="learner steps between evaluations")
    run.add_argument("--eval_episodes", type=int, default=1, help="greedy episodes per evaluation and policy")
    run.add_argument("--checkpoint_period", type=int, default=5000, help="learner steps between checkpoints")
    run.add_argument("--results_dir", default=None,
                     help="results directory (default: results/<agent>_<task>_q<bits>_s<seed>_<time>)")
    run.add_argument("--resume", default=None, metavar="RESULTS_DIR",
                     help="continue the run in RESULTS_DIR from its last checkpoint")
    run.add_argument("--country", default="USA", help="ISO 3166 alpha-3 code for codecarbon's carbon intensity")
    run.add_argument("--actor_threads", type=int, default=1, help="XLA/intra-op threads per actor")
    run.add_argument("--learner_threads", type=int, default=0, help="XLA threads of the learner (0: all cores)")
    run.add_argument("--max_actor_restarts", type=int, default=3, help="restarts per actor before giving up on it")
    run.add_argument("--port", type=int, default=0, help="Reverb port of the learner (0: a free one)")
    hyper = parser.add_argument_group(f"{agent} hyper-parameters")
    hints = typing.get_type_hints(agent_config_cls)
    for field in dataclasses.fields(agent_config_cls):
        hint = hints[field.name]
        name = f"--{field.name}"
        if field.name in _LAYER_FLAGS[agent]:
            hyper.add_argument(name, type=_parse_layers, default=field.default, help="comma list of hidden sizes")
        elif hint is bool:
            hyper.add_argument(name, type=_parse_bool, default=field.default, help="true/false")
        elif hint in (int, float, str):
            hyper.add_argument(name, type=hint, default=field.default)
    return parser


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes"):
        return True
    if lowered in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_run(agent: str, agent_config_cls: type, argv: Optional[Sequence[str]], description: str) -> Tuple[RunConfig, Any]:
    """Parses and validates flags into (RunConfig, agent config); exits 2 naming the flag when invalid."""
    parser = build_parser(agent, agent_config_cls, description)
    args = parser.parse_args(argv)
    if args.resume:
        return _resume(parser, args.resume, argv)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["agent"] = agent
    values["resume"] = False
    if values["num_actors"] < 1:
        parser.error(f"--num_actors must be >= 1, got {values['num_actors']}")
    for flag, message in validate_run_fields({**values, "comm_bits": values.get("comm_bits")}):
        parser.error(f"--{flag}: {message}")
    from actorq_jax.environments import available_tasks

    tasks = available_tasks()
    if args.task not in tasks:
        parser.error(f"--task: unknown task {args.task!r}; valid tasks: {', '.join(tasks)}")
    if values["results_dir"] is None:
        import time

        stamp = time.strftime("%Y%m%d-%H%M%S")
        values["results_dir"] = f"results/{agent}_{args.task}_q{args.actor_bits}_s{args.seed}_{stamp}"
    results = Path(values["results_dir"])
    if (results / "config.json").exists():
        parser.error(f"--results_dir: {results} already holds a run; pick another or use --resume {results}")
    agent_values = {f.name: getattr(args, f.name) for f in dataclasses.fields(agent_config_cls) if hasattr(args, f.name)}
    try:
        agent_config = agent_config_cls(**agent_values)
    except ValueError as error:
        parser.error(str(error))
    return RunConfig(**values), agent_config


def _resume(parser: argparse.ArgumentParser, results_dir: str, argv: Optional[Sequence[str]]) -> Tuple[RunConfig, Any]:
    from actorq_jax.launch.config import config_from_json

    path = Path(results_dir) / "config.json"
    if not path.exists():
        parser.error(f"--resume: {results_dir} has no config.json (not a results directory)")
    run, agent_config = config_from_json(path.read_text())
    # Budgets may be raised when resuming; everything else stays as the run was configured.
    args = parser.parse_args(argv)
    budgets = {k: getattr(args, k) for k in ("max_env_steps", "max_learner_steps", "max_seconds") if getattr(args, k) is not None}
    return dataclasses.replace(run, resume=True, **budgets), agent_config
