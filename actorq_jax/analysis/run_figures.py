"""The end-to-end figures of one finished run: time, env steps and energy to a target return, rates, what bound it.

Used by benchmarks/end_to_end.py and the README's demo. Reads summary.json and
eval.csv; needs no JAX.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional

import pandas as pd

from actorq_jax.analysis.aggregate import time_to_target
from actorq_jax.run_dir import NARROW_WINDOW_EVENT, RunDir
from actorq_jax.telemetry import ACTOR_PHASES
from actorq_jax.telemetry.schema import CPU_CLOCK

BITS = (32, 8)  # the end-to-end comparison: full-precision actors against int8 ones


def measure_run(run_dir: Path, threshold: float, cores: Optional[int] = None) -> Dict[str, Any]:
    """The figures of one finished run: time/env steps/energy to target, rates, final return, actor phases.

    Time to target is `actorq_jax.analysis.aggregate.time_to_target`: a run that
    never reaches `threshold` has reached False and NaN time, env steps and
    energy to target. `cores`: how many the run's machine gave it, for runs whose
    summary does not say which cores each worker had (see core_load).
    """
    summary = json.loads(RunDir(run_dir).summary.read_text())
    config = json.loads(RunDir(run_dir).config.read_text()).get("run", {}) if RunDir(run_dir).config.is_file() else {}
    eval_path = RunDir(run_dir).eval_csv
    evals = pd.read_csv(eval_path) if eval_path.is_file() and eval_path.stat().st_size else pd.DataFrame()
    reach = time_to_target(evals, threshold)
    wall = float(summary["wall_seconds"])
    energy = float(summary.get("energy_kwh") or math.nan)
    phases = {p: float(summary.get("actor_time_s", {}).get(p, 0.0)) for p in ACTOR_PHASES}
    # Per-phase CPU only from runs timed with the process clock (older runs timed one thread).
    cpu = summary.get("actor_cpu_time_s") if summary.get("cpu_clock") == CPU_CLOCK else None
    return {
        "reached": reach.reached,
        "time_to_target_s": reach.wall_seconds,
        # How long a miss was watched: its last evaluation's time (a lower bound on its time to target).
        "last_eval_s": float(evals["wall_seconds"].max()) if "wall_seconds" in evals.columns else math.nan,
        "env_steps_to_target": reach.env_steps,
        "energy_to_target_kwh": energy * min(1.0, reach.wall_seconds / wall) if reach.reached and wall > 0 else math.nan,
        "env_steps_per_s": float(summary["env_steps"]) / wall if wall > 0 else 0.0,
        "learner_steps_per_s": float(summary["learner_steps"]) / wall if wall > 0 else 0.0,
        # A run stopped before its evaluator's final evaluation has none: NaN, as for a miss.
        "final_return": _number(summary.get("final_eval_return")),
        "actor_phase_s": phases,
        "bound_by": bottleneck(phases, cpu, core_load(summary, config, cores)) + _narrow_window(summary),
    }


def _narrow_window(summary: Dict[str, Any]) -> str:
    """A note for the bottleneck line when the launcher said the run's replay table sat at --min_replay_size: its
    learner took every item as soon as it came (bound by the actors' data), drawing from the newest items only."""
    narrow = any(str(event).startswith(NARROW_WINDOW_EVENT) for event in summary.get("events", []))
    return "; learner at the data bound, replay held at --min_replay_size" if narrow else ""


def _worker_cores(summary: Dict[str, Any], config: Dict[str, Any], cores: Optional[int]) -> Dict[str, List[int]]:
    """The cores each worker could use: as the run recorded them, else from its flags and the machine's cores."""
    if summary.get("worker_cores"):
        return summary["worker_cores"]
    if cores is None or config.get("launcher", "local") != "local":
        return {}
    from types import SimpleNamespace

    from actorq_jax.launch.runtime import role_cpus  # imports no JAX

    every, run = list(range(cores)), SimpleNamespace(**config)
    # Worker names are roles ("learner", "replay", "evaluator") or actor_N, which role_cpus places as actors.
    return {name: list(role_cpus(name, run, every)) or every for name in summary.get("worker_cpu_s", {})}


def core_load(summary: Dict[str, Any], config: Dict[str, Any], cores: Optional[int] = None) -> Optional[Dict[str, float]]:
    """How busy the actors' cores were over the run: "busy" (CPU-seconds of every worker sharing them per
    wall second and core) and each such worker's share; None where the run did not record its workers' CPU."""
    cpu, wall = summary.get("worker_cpu_s") or {}, float(summary.get("wall_seconds") or 0.0)
    placed = _worker_cores(summary, config, cores)
    actor_cores = set().union(*(set(c) for n, c in placed.items() if n.startswith("actor")))
    if not cpu or wall <= 0 or not actor_cores:
        return None
    capacity = wall * len(actor_cores)
    sharing = {name: seconds for name, seconds in cpu.items() if set(placed.get(name, ())) & actor_cores}
    load = {"busy": sum(sharing.values()) / capacity}
    for name, seconds in sharing.items():
        key = "actors" if name.startswith("actor") else {"replay": "replay service"}.get(name, name)
        load[key] = load.get(key, 0.0) + seconds / capacity
    return load


def _mean(values: List[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.fmean(finite) if finite else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b and a == a and b == b else math.nan


def speedup_at_least(q32: List[Dict[str, Any]], q8: List[Dict[str, Any]]) -> float:
    """A lower bound on the time-to-target speedup of q=8 when q=32 runs missed: each miss counts as the time
    of its last evaluation (it reached later, if ever); NaN unless every q=8 run reached the target."""
    if not q8 or not q32 or not all(r["reached"] for r in q8):
        return math.nan
    watched = [r["time_to_target_s"] if r["reached"] else r.get("last_eval_s", math.nan) for r in q32]
    return _ratio(statistics.fmean(watched), statistics.fmean(r["time_to_target_s"] for r in q8))


def headline(rows: List[Dict[str, Any]], layout: str) -> Dict[str, float]:
    """The end-to-end benchmark's keys for one layout from measure_run rows with layout and bits (BENCHMARKS.md):
    q=8 over q=32 ratios; time and energy are means over the runs that reached the target, and
    time_to_target_speedup_q8_at_least bounds the speedup from below when q=32 runs missed (speedup_at_least)."""
    by_bits = {b: [r for r in rows if r["layout"] == layout and r["bits"] == b] for b in BITS}
    mean = {b: {k: _mean([r[k] for r in by_bits[b]]) for k in
                ("time_to_target_s", "energy_to_target_kwh", "env_steps_per_s", "learner_steps_per_s", "final_return")}
            for b in BITS}
    suffix = "" if layout == "pinned" else "_shared"
    return {
        f"time_to_target_speedup_q8{suffix}": _ratio(mean[32]["time_to_target_s"], mean[8]["time_to_target_s"]),
        f"time_to_target_speedup_q8_at_least{suffix}": speedup_at_least(by_bits[32], by_bits[8]),
        f"energy_to_target_ratio_q8{suffix}": _ratio(mean[32]["energy_to_target_kwh"], mean[8]["energy_to_target_kwh"]),
        f"env_steps_per_s_ratio_q8{suffix}": _ratio(mean[8]["env_steps_per_s"], mean[32]["env_steps_per_s"]),
        f"learner_steps_per_s_ratio_q8{suffix}": _ratio(mean[8]["learner_steps_per_s"], mean[32]["learner_steps_per_s"]),
        f"final_return_q32{suffix}": mean[32]["final_return"],
        f"final_return_q8{suffix}": mean[8]["final_return"],
        f"runs_reached_target_q32{suffix}": float(sum(r["reached"] for r in by_bits[32])),
        f"runs_reached_target_q8{suffix}": float(sum(r["reached"] for r in by_bits[8])),
    }


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


FULL = 0.9  # the actors' cores count as full at this share of their capacity (sampling misses a process's last moments)


def bottleneck(phases: Dict[str, float], cpu_phases: Optional[Dict[str, float]] = None,
               load: Optional[Dict[str, float]] = None) -> str:
    """What bound the run, from its timers: the limiter (learner-bound actors), the actors' core, or their largest phase.

    `cpu_phases` (the same phases' CPU seconds) tells a phase that computes from one
    that waits for a core shared with other processes: actors that computed under
    half of their working wall time were bound by CPU, not by any phase's work.
    `load` (core_load) names who filled the actors' cores, the replay service included.
    """
    total = sum(phases.values())
    if total <= 0:
        return "unknown (no actor episodes)"
    wait = phases.get("rate_limit_wait", 0.0)
    if wait / total > 0.3:
        return f"learner (actors blocked on the rate limiter {wait / total:.0%} of their time)"
    work = {p: s for p, s in phases.items() if p != "rate_limit_wait"}
    name = max(work, key=work.get)
    label = {"env_step": "env", "inference": "actor inference", "adder": "replay writes"}.get(name, f"variables ({name})")
    largest = f"{label} ({work[name] / total:.0%} of actor time)"
    working = sum(work.values())
    if load and load["busy"] >= FULL:
        shares = ", ".join(f"{name} {share:.0%}" for name, share in sorted(load.items(), key=lambda kv: -kv[1])
                           if name != "busy")
        return f"CPU on the actors' cores ({load['busy']:.0%} busy: {shares}; largest actor phase {largest})"
    if cpu_phases and working > 0:
        busy = sum(float(cpu_phases.get(p, 0.0)) for p in work) / working
        if busy < 0.5:
            return f"CPU on the actors' cores (actors computing {busy:.0%} of their working time; largest phase {largest})"
    return largest
