"""The end-to-end figures of one finished run: time, env steps and energy to a target return, rates, what bound it.

Used by benchmarks/end_to_end.py and the README's demo. Reads summary.json and
eval.csv; needs no JAX.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict

import pandas as pd

from actorq_jax.analysis.aggregate import time_to_target
from actorq_jax.run_dir import RunDir
from actorq_jax.telemetry import ACTOR_PHASES


def measure_run(run_dir: Path, threshold: float) -> Dict[str, Any]:
    """The figures of one finished run: time/env steps/energy to target, rates, final return, actor phases.

    Time to target is `actorq_jax.analysis.aggregate.time_to_target`: a run that
    never reaches `threshold` has reached False and NaN time, env steps and
    energy to target.
    """
    summary = json.loads(RunDir(run_dir).summary.read_text())
    eval_path = RunDir(run_dir).eval_csv
    evals = pd.read_csv(eval_path) if eval_path.is_file() and eval_path.stat().st_size else pd.DataFrame()
    reach = time_to_target(evals, threshold)
    wall = float(summary["wall_seconds"])
    energy = float(summary.get("energy_kwh") or math.nan)
    phases = {p: float(summary.get("actor_time_s", {}).get(p, 0.0)) for p in ACTOR_PHASES}
    return {
        "reached": reach.reached,
        "time_to_target_s": reach.wall_seconds,
        "env_steps_to_target": reach.env_steps,
        "energy_to_target_kwh": energy * min(1.0, reach.wall_seconds / wall) if reach.reached and wall > 0 else math.nan,
        "env_steps_per_s": float(summary["env_steps"]) / wall if wall > 0 else 0.0,
        "learner_steps_per_s": float(summary["learner_steps"]) / wall if wall > 0 else 0.0,
        # A run stopped before its evaluator's final evaluation has none: NaN, as for a miss.
        "final_return": _number(summary.get("final_eval_return")),
        "actor_phase_s": phases,
        "bound_by": bottleneck(phases),
    }


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def bottleneck(phases: Dict[str, float]) -> str:
    """What bound the run, from its timers: the limiter (learner-bound actors), or the actors' largest phase."""
    total = sum(phases.values())
    if total <= 0:
        return "unknown (no actor episodes)"
    wait = phases.get("rate_limit_wait", 0.0)
    if wait / total > 0.3:
        return f"learner (actors blocked on the rate limiter {wait / total:.0%} of their time)"
    work = {p: s for p, s in phases.items() if p != "rate_limit_wait"}
    name = max(work, key=work.get)
    label = {"env_step": "env", "inference": "actor inference", "adder": "replay writes"}.get(name, f"variables ({name})")
    return f"{label} ({work[name] / total:.0%} of actor time)"
