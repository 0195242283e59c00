"""The end-to-end figures of one finished run: time, env steps and energy to a target return, rates, what bound it.

Used by benchmarks/end_to_end.py and the README's demo. Reads summary.json and
eval.csv; needs no JAX.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional

from actorq_jax.telemetry import ACTOR_PHASES, read_csv


def first_reach(evals: List[Dict[str, Any]], threshold: float) -> Optional[Dict[str, Any]]:
    """The first evaluation row whose return is at or above threshold (None if none is)."""
    for row in evals:
        if row["return"] is not None and row["return"] >= threshold:
            return row
    return None


def measure_run(run_dir: Path, threshold: float, budget_s: float) -> Dict[str, Any]:
    """The figures of one finished run: time/env steps/energy to target, rates, final return, actor phases."""
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = [r for r in read_csv(run_dir / "eval.csv") if r["policy"] == "fp32"]
    periodic = [r for r in evals if not r["final"]]
    reached = first_reach(periodic, threshold)
    wall = float(summary["wall_seconds"])
    # A run that misses counts its whole budget, or as long as it was still evaluated past the budget
    # (the learner runs on until the launcher stops it), so a miss never looks faster than a late hit.
    last_eval = max((float(r["wall_seconds"]) for r in periodic), default=0.0)
    time_to_target = float(reached["wall_seconds"]) if reached else max(budget_s, last_eval)
    energy = float(summary.get("energy_kwh") or math.nan)
    phases = {p: float(summary.get("actor_time_s", {}).get(p, 0.0)) for p in ACTOR_PHASES}
    return {
        "reached": reached is not None,
        "time_to_target_s": time_to_target,
        "env_steps_to_target": int(reached["env_steps"]) if reached else int(summary["env_steps"]),
        "energy_to_target_kwh": energy * min(1.0, time_to_target / wall) if wall > 0 else math.nan,
        "env_steps_per_s": float(summary["env_steps"]) / wall if wall > 0 else 0.0,
        "learner_steps_per_s": float(summary["learner_steps"]) / wall if wall > 0 else 0.0,
        "final_return": float(summary["final_eval_return"]),
        "actor_phase_s": phases,
        "bound_by": bottleneck(phases),
    }


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
