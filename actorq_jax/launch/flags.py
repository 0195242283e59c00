"""Command-line flags of the run scripts, derived from RunConfig and the agent's config.

Flags are parsed only at the entry points; everything below them takes the
typed RunConfig and agent config. Each flag's default and help are the config
field's own (actorq_jax.config.documented). Invalid values exit with code 2
before any process starts, naming the flag.
"""

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from actorq_jax.agents.registry import get_agent
from actorq_jax.config import add_config_flags, flag_fields
from actorq_jax.launch.config import BUDGETS, CPU_FLAGS, RunConfig, config_from_json, run_config_problems
from actorq_jax.launch.runtime import cpu_list_problem
from actorq_jax.run_dir import RunDir

# RunConfig fields the parser handles itself rather than as plain flags.
_SPECIAL_RUN_FIELDS = ("agent", "resume")


def build_parser(agent: str, description: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser of one agent's run script: run flags plus the agent's hyper-parameters."""
    entry = get_agent(agent)
    parser = argparse.ArgumentParser(description=description or entry.description, allow_abbrev=False)
    run = parser.add_argument_group("run")
    add_config_flags(run, RunConfig, skip=_SPECIAL_RUN_FIELDS)
    run.set_defaults(task=entry.default_task, results_dir=None)
    run.add_argument("--resume", default=None, metavar="RESULTS_DIR",
                     help="continue the run in RESULTS_DIR from its last checkpoint (budget flags may be raised, roles placed "
                          "anew with --layout and --*_cpus, *_learning_rate flags changed)")
    add_config_flags(parser.add_argument_group(f"{agent} hyper-parameters"), entry.config_class)
    return parser


def parse_run(agent: str, argv: Optional[Sequence[str]], description: Optional[str] = None) -> Tuple[RunConfig, Any]:
    """Parses and validates flags into (RunConfig, agent config); exits 2 naming the flag when invalid."""
    entry = get_agent(agent)
    parser = build_parser(agent, description)
    args = parser.parse_args(argv)
    if args.resume:
        return _resume(parser, args, list(sys.argv[1:] if argv is None else argv), agent)
    values = {f.name: getattr(args, f.name) for f in flag_fields(RunConfig, skip=_SPECIAL_RUN_FIELDS)}
    values["agent"] = agent
    if values["results_dir"] is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        values["results_dir"] = f"results/{agent}_{values['task']}_q{values['actor_bits']}_s{values['seed']}_{stamp}"
    probe = argparse.Namespace(**values)
    for flag, message in run_config_problems(probe):
        parser.error(f"--{flag}: {message}")
    from actorq_jax.launch.ray_flags import ray_flag_problems  # never imports Ray under --launcher local

    for flag, message in ray_flag_problems(probe):
        parser.error(f"--{flag}: {message}")
    for flag, message in placement_problems(probe):
        parser.error(f"--{flag}: {message}")
    from actorq_jax.environments import available_tasks

    tasks = available_tasks()
    if values["task"] not in tasks:
        parser.error(f"--task: unknown task {values['task']!r}; valid tasks: {', '.join(tasks)}")
    problem = task_problem(entry, values["task"])
    if problem:
        parser.error(f"--task: {problem}")
    problem = country_problem(values["country"])
    if problem:
        parser.error(f"--country: {problem}")
    results = Path(values["results_dir"])
    problem = results_dir_problem(results)
    if problem:
        parser.error(f"--results_dir: {problem}")
    if RunDir(results).config.exists():
        parser.error(f"--results_dir: {results} already holds a run; pick another or use --resume {results}")
    agent_values = {f.name: getattr(args, f.name) for f in flag_fields(entry.config_class)}
    try:
        agent_config = entry.config_class(**agent_values)
    except ValueError as error:
        # Config errors read "<Config>.<field> ..."; name the flag the user typed.
        field = str(error).split(" ", 1)[0].rpartition(".")[2]
        parser.error(f"--{field}: {error}" if field in agent_values else str(error))
    return RunConfig(**values), agent_config


def placement_problems(run: Any) -> List[Tuple[str, str]]:
    """(flag, why) for each core placement this machine cannot give: cores it lacks, a pinned layout on one core."""
    problems = [(name, problem) for name in CPU_FLAGS for problem in [cpu_list_problem(getattr(run, name))] if problem]
    if run.layout == "pinned" and len(os.sched_getaffinity(0)) < 2:
        problems.append(("layout", f"pinned needs at least 2 cores; this process has {len(os.sched_getaffinity(0))}"))
    return problems


def country_problem(country: str) -> Optional[str]:
    """Why codecarbon cannot price `country`'s energy (None when it can), checked before the run starts."""
    from actorq_jax.telemetry.energy import known_country_codes

    if country.upper() in known_country_codes():
        return None
    return (f"unknown country code {country!r}; codecarbon knows ISO 3166-1 alpha-3 codes such as USA, FRA, DEU, "
            "GBR, CAN, IND, CHN")


# MuJoCo's mjMAXVAL: dm_control reports an actuator without a control range (LQR's) as +-1e10.
UNBOUNDED_ACTION = 1e10


def task_problem(entry: Any, task: str) -> Optional[str]:
    """Why agent `entry` cannot act in `task` (None when it can): it cannot start here, or its actions are of
    the other kind."""
    import numpy as np

    from actorq_jax.environments import environment_spec, make_environment

    env = make_environment(task, seed=0)
    try:
        env.reset()
    except RuntimeError as error:
        # quadruped_escape draws its terrain with OpenGL at reset: every worker would fail the same way.
        hint = ("; it needs an OpenGL backend (MUJOCO_GL=egl or osmesa on a machine that has one)"
                if "OpenGL" in str(error) else "")
        return f"{task} cannot start on this machine ({error}){hint}"
    if entry.actions == "any":
        return None
    spec = environment_spec(env)
    kind = "discrete" if spec.discrete else "continuous"
    if kind == entry.actions:
        if kind == "continuous" and not (np.all(np.abs(spec.action_minimum) < UNBOUNDED_ACTION)
                                         and np.all(np.abs(spec.action_maximum) < UNBOUNDED_ACTION)):
            # The policy squashes its output into the action bounds: with these its first actions are ~1e6 and
            # the physics, then the learner, diverge.
            shown = {name: " ".join(f"{v:g}" for v in np.ravel(values))
                     for name, values in (("minimum", spec.action_minimum), ("maximum", spec.action_maximum))}
            return (f"{task} has unbounded actions (minimum {shown['minimum']}, maximum {shown['maximum']}); "
                    f"{entry.name} needs finite action bounds")
        return None
    size = f"{spec.num_actions} discrete actions" if spec.discrete else f"{spec.action_dim} continuous action(s)"
    return (f"{task} has {size}; {entry.name} needs a task with {entry.actions} actions "
            f"(its default: {entry.default_task})")


def results_dir_problem(path: Path) -> Optional[str]:
    """Why a run cannot write its results under `path` (None when it can): found before anything starts."""
    import tempfile

    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{path} cannot be created: {existing} is a file, not a directory"
    try:
        # Permission bits say nothing to root, and nothing of a read-only or full file system: try a write.
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".actorq-probe-") as probe:
            probe.write(b"x")
            probe.flush()
    except OSError as error:
        return f"{path} cannot be written: {error.strerror or error} (in {existing})"
    return None


def resumable_agent_fields(config_class: Any) -> Tuple[str, ...]:
    """Agent hyper-parameters a resumed run may change: step sizes (a diverged run resumes with a smaller one)."""
    return tuple(f.name for f in dataclasses.fields(config_class) if f.name.endswith("learning_rate"))


def _given(argv: Sequence[str], name: str) -> bool:
    return any(arg == f"--{name}" or arg.startswith(f"--{name}=") for arg in argv)


# Run flags a resumed run may change: its budgets and stop condition, and where its cluster is now.
# Where the roles run is not part of the run: a run moved to another machine (or resumed with other cores free)
# may be placed anew.
PLACEMENT_FIELDS = ("layout", *CPU_FLAGS)
RESUMABLE_RUN_FIELDS = (*BUDGETS, "stop_at_return", "ray_address", *PLACEMENT_FIELDS)


def _same(given: Any, kept: Any) -> bool:
    # JSON has no tuples: a layer list kept in config.json compares equal to the same flag's tuple.
    return (tuple(given) if isinstance(given, list) else given) == (tuple(kept) if isinstance(kept, list) else kept)


def _resume(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str],
            agent: str) -> Tuple[RunConfig, Any]:
    results = Path(args.resume)
    path = RunDir(results).config
    if not path.exists():
        parser.error(f"--resume: {args.resume} has no config.json (not a results directory)")
    problem = results_dir_problem(results)
    if problem:
        parser.error(f"--resume: {problem}")
    try:
        run, agent_config = config_from_json(path.read_text())
    except ValueError as error:
        parser.error(f"--resume: {path}: {error}")
    if run.agent != agent:
        parser.error(f"--resume: {args.resume} holds a {run.agent} run, not {agent}; resume it with "
                     f"experiments/run.py --agent {run.agent} --resume {args.resume}")
    if _given(argv, "results_dir") and Path(args.results_dir).resolve() != results.resolve():
        parser.error(f"--results_dir: {args.results_dir} is not the resumed run's directory {args.resume}; "
                     "--resume alone names where the run goes on")
    # A flag given with another value than the run was configured with would be silently dropped: refuse it.
    resumable = (*RESUMABLE_RUN_FIELDS, *resumable_agent_fields(type(agent_config)))
    for config in (run, agent_config):
        for field in flag_fields(type(config), skip=(*_SPECIAL_RUN_FIELDS, "results_dir")):
            name = field.name
            kept = getattr(config, name)
            if name == "comm_bits" and kept is None:
                kept = run.actor_bits  # unset means the actors' width: giving that width keeps the run's wire
            if name in resumable or not _given(argv, name) or _same(getattr(args, name), kept):
                continue
            parser.error(f"--{name}: the resumed run has {kept!r}, which a resume keeps; it may change "
                         f"only {', '.join('--' + n for n in resumable)}; start a new run to change --{name}")
    # The directory named now, not the one config.json recorded: the run may have moved, or be resumed from
    # another working directory than the relative path it was started with.
    overrides = {k: getattr(args, k) for k in (*BUDGETS, "stop_at_return") if getattr(args, k) is not None}
    overrides["results_dir"] = str(results)
    if args.ray_address:
        overrides["ray_address"] = args.ray_address
    overrides.update({k: getattr(args, k) for k in PLACEMENT_FIELDS if _given(argv, k)})
    agent_overrides = {k: getattr(args, k) for k in resumable_agent_fields(type(agent_config)) if _given(argv, k)}
    try:
        resumed = dataclasses.replace(run, resume=True, **overrides), dataclasses.replace(agent_config, **agent_overrides)
    except ValueError as error:
        parser.error(str(error))
    for flag, message in run_config_problems(resumed[0]):  # the placement flags a resume may give
        parser.error(f"--{flag}: {message}")
    for flag, message in placement_problems(resumed[0]):
        kept = "" if _given(argv, flag) else f" (the resumed run's; a resume may give --{flag} anew)"
        parser.error(f"--{flag}: {message}{kept}")
    return resumed
