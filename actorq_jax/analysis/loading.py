"""Reads ActorQ results directories (one run, or a sweep of runs) into pandas DataFrames.

Only pandas and the standard library: notebooks and plot scripts load results
without starting JAX. A run directory is any folder holding a config.json
written by the launcher; a sweep directory holds runs as sub-folders and,
when experiments/sweep.py made it, a sweep.json index.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import pandas as pd

from actorq_jax.run_dir import RunDir
from actorq_jax.telemetry.schema import ACTOR_PHASES

PathLike = Union[str, Path]

# Phases an actor's time is split into, in the order bars are stacked.
PHASES = ACTOR_PHASES
SWEEP_INDEX = "sweep.json"

# Columns every runs frame has, so empty or partial sweeps still slice and aggregate.
RUN_COLUMNS = (
    "run", "run_dir", "agent", "task", "bits", "comm_bits", "seed", "num_actors", "actors", "policy", "layout", "regime",
    "granularity",
    "actor_backend", "complete", "exit_code", "wall_seconds", "env_steps", "learner_steps",
    "env_steps_per_second", "energy_kwh", "emissions_kg", "final_eval_return", "best_eval_return",
    "final_eval_return_actor_policy", "best_eval_return_actor_policy", "actor_episodes", "cpu_clock", "replay_cpu_s",
    "actor_policy_backends", "machine",
) + tuple(f"actor_{p}_s" for p in PHASES)
# Run metadata copied onto every row of the per-run streams.
META_COLUMNS = ("run", "task", "bits", "seed")


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error


def is_run_dir(path: PathLike) -> bool:
    """Whether `path` holds a run written by the launcher (it has a config.json)."""
    return RunDir(path).config.is_file()


def find_run_dirs(sweep_dir: PathLike) -> List[Path]:
    """Run directories of a sweep: those in sweep.json, else sub-folders with a config.json (or the folder itself)."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"results directory {str(root)!r} does not exist")
    if is_run_dir(root):
        return [root]
    index = root / SWEEP_INDEX
    listed: List[Path] = []
    if index.is_file():
        for entry in _read_json(index).get("runs", []):
            path = root / entry["dir"]
            if is_run_dir(path):
                listed.append(path)
    # Runs added by hand (or by another sweep into the same folder) count too.
    found = sorted(p for p in root.iterdir() if p.is_dir() and is_run_dir(p))
    return listed + [p for p in found if p not in listed]


def _nan_if_none(value: Any) -> Any:
    return math.nan if value is None else value


def _regime(agent: Dict[str, Any]) -> str:
    """The replay regime in a few words: "ratio 8" (samples per insert) or "min_size 8" (max times sampled)."""
    limiter = agent.get("rate_limiter")
    if limiter == "ratio":
        return f"ratio {agent.get('samples_per_insert', math.nan):g}"
    if limiter == "min_size":
        return f"min_size {agent.get('max_times_sampled', '?')}"
    return str(limiter or "unknown")


def _policy(agent: Dict[str, Any]) -> str:
    """The acting network's hidden layers in short: "256x3" (three of 256), else "64-128"; "?" when not recorded."""
    layers = agent.get("policy_layers") or agent.get("q_layers")
    if not layers:
        return "?"
    sizes = [int(v) for v in layers]
    return f"{sizes[0]}x{len(sizes)}" if len(set(sizes)) == 1 else "-".join(map(str, sizes))


def read_run(run_dir: PathLike) -> Dict[str, Any]:
    """One row describing a run: its configuration and, when it finished, its summary."""
    path = Path(run_dir)
    config = _read_json(RunDir(path).config)
    run, agent = config.get("run", {}), config.get("agent", {})
    comm_bits = run.get("comm_bits")
    row: Dict[str, Any] = {column: math.nan for column in RUN_COLUMNS}
    row.update({
        "run": path.name,
        "run_dir": str(path),
        "agent": run.get("agent"),
        "task": run.get("task"),
        "bits": int(run["actor_bits"]),
        "comm_bits": int(run["actor_bits"] if comm_bits is None else comm_bits),
        "seed": int(run.get("seed", 0)),
        "num_actors": run.get("num_actors"),
        # The actor layout: processes x environments each ("2x1": two single-environment actors).
        "actors": f"{run.get('num_actors')}x{run.get('envs_per_actor', 1)}",
        "policy": _policy(agent),  # the actors' network: a time split means nothing across policy sizes
        "layout": run.get("layout", "shared"),  # runs from before --layout shared every core
        "regime": _regime(agent),
        "granularity": run.get("granularity"),
        "actor_backend": run.get("actor_backend"),
        "complete": False,
    })
    summary_path = RunDir(path).summary
    if summary_path.is_file():
        summary = _read_json(summary_path)
        row["complete"] = True
        for key in ("exit_code", "wall_seconds", "env_steps", "learner_steps", "env_steps_per_second",
                    "energy_kwh", "emissions_kg", "final_eval_return", "best_eval_return",
                    "final_eval_return_actor_policy", "best_eval_return_actor_policy", "actor_episodes", "cpu_clock"):
            if key in summary:
                row[key] = _nan_if_none(summary[key])
        # The replay service's CPU seconds (launcher-measured; runs before that, or under Ray: NaN).
        row["replay_cpu_s"] = _nan_if_none((summary.get("worker_cpu_s") or {}).get("replay"))
        # The launcher's CPU, with its family and model numbers (runs before it was recorded: missing).
        machine = summary.get("machine") or {}
        row["machine"] = (f"{machine.get('cpu')} ({machine['cpu_id']})" if machine.get("cpu_id")
                          else machine.get("cpu")) or None
        # What computed the actors' policies ("int8/w8a8/amx", ...; runs before it was recorded: None).
        row["actor_policy_backends"] = ",".join(summary.get("actor_policy_backends") or []) or None
        for phase, seconds in (summary.get("actor_time_s") or {}).items():
            if phase in PHASES:
                row[f"actor_{phase}_s"] = _nan_if_none(seconds)
    return row


def load_runs(run_dirs: Iterable[PathLike]) -> pd.DataFrame:
    """One row per run (columns RUN_COLUMNS), ordered by task, bits (high to low) and seed."""
    rows = [read_run(d) for d in run_dirs]
    frame = pd.DataFrame(rows, columns=list(RUN_COLUMNS))
    if frame.empty:
        return frame
    return frame.sort_values(["task", "bits", "seed"], ascending=[True, False, True], ignore_index=True)


def _read_stream(runs: pd.DataFrame, relative: str, rename: Optional[Dict[str, str]] = None) -> pd.DataFrame:
    frames = []
    for run in runs.itertuples(index=False):
        for path in sorted(Path(run.run_dir).glob(relative)):
            if path.stat().st_size == 0:
                continue
            frame = pd.read_csv(path)
            if rename:
                frame = frame.rename(columns=rename)
            for column in reversed(META_COLUMNS):
                frame.insert(0, column, getattr(run, column))
            frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=list(META_COLUMNS))
    return pd.concat(frames, ignore_index=True)


def load_evals(runs: pd.DataFrame) -> pd.DataFrame:
    """Every evaluation episode of every run (eval.csv), with run metadata; eval's `bits` becomes `policy_bits`."""
    return _read_stream(runs, RunDir.EVAL_CSV, rename={"bits": "policy_bits"})


def load_actor_episodes(runs: pd.DataFrame) -> pd.DataFrame:
    """Every actor episode of every run (actors/actor_<i>.csv), with run metadata."""
    return _read_stream(runs, f"{RunDir.ACTORS}/{RunDir.ACTOR_CSV_GLOB}")


def load_learner(runs: pd.DataFrame) -> pd.DataFrame:
    """The learner's logged steps of every run (learner.csv), with run metadata."""
    return _read_stream(runs, RunDir.LEARNER_CSV)


def _as_set(values: Union[None, Any, Sequence[Any]]) -> Optional[set]:
    if values is None:
        return None
    if isinstance(values, (str, int)):
        return {values}
    return set(values)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """The runs of a sweep and their streams, as DataFrames sharing the columns run, task, bits, seed."""

    path: Path
    runs: pd.DataFrame
    evals: pd.DataFrame
    actors: pd.DataFrame
    learner: pd.DataFrame
    index: Dict[str, Any]

    def select(self, task: Any = None, bits: Any = None, seed: Any = None) -> "Sweep":
        """The sweep restricted to some tasks, bit-widths and seeds (each a value, a list, or None for all)."""
        wanted = {"task": _as_set(task), "bits": _as_set(bits), "seed": _as_set(seed)}

        def keep(frame: pd.DataFrame) -> pd.DataFrame:
            mask = pd.Series(True, index=frame.index)
            for column, values in wanted.items():
                if values is not None:
                    mask &= frame[column].isin(values)
            return frame[mask].reset_index(drop=True)

        return dataclasses.replace(self, runs=keep(self.runs), evals=keep(self.evals),
                                   actors=keep(self.actors), learner=keep(self.learner))


def load_sweep(sweep_dir: PathLike) -> Sweep:
    """Loads every run under `sweep_dir` (or the single run it is) into a Sweep."""
    root = Path(sweep_dir)
    run_dirs = find_run_dirs(root)
    if not run_dirs:
        raise FileNotFoundError(f"no runs (folders with a config.json) under {str(root)!r}")
    runs = load_runs(run_dirs)
    index_path = root / SWEEP_INDEX
    index = _read_json(index_path) if index_path.is_file() else {}
    return Sweep(path=root, runs=runs, evals=load_evals(runs), actors=load_actor_episodes(runs),
                 learner=load_learner(runs), index=index)
