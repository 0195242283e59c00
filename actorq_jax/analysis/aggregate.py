"""Aggregations of loaded runs: evaluation curves, bands over seeds, time to target, speedup, actor time."""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import pandas as pd

from actorq_jax.analysis.loading import META_COLUMNS, PHASES

X_COLUMNS = ("wall_seconds", "env_steps", "learner_steps")
BASELINE_BITS = 32


def _check_x(x: str) -> None:
    if x not in X_COLUMNS:
        raise ValueError(f"x must be one of {X_COLUMNS}, got {x!r}")


def eval_points(evals: pd.DataFrame, policy: str = "fp32") -> pd.DataFrame:
    """One row per evaluation of `policy` in each run: mean return over its episodes, when and after how many steps."""
    if policy not in ("fp32", "actor"):
        raise ValueError(f"policy must be 'fp32' or 'actor', got {policy!r}")
    columns = list(META_COLUMNS) + ["learner_steps", "final", "wall_seconds", "env_steps", "return", "episodes"]
    if evals.empty or "policy" not in evals.columns:
        return pd.DataFrame(columns=columns)
    rows = evals[evals["policy"] == policy]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    # An evaluation is known once its last episode ends, so it is timed by the latest episode.
    points = (
        rows.groupby(list(META_COLUMNS) + ["learner_steps", "final"], sort=False)
        .agg(wall_seconds=("wall_seconds", "max"), env_steps=("env_steps", "max"),
             **{"return": ("return", "mean")}, episodes=("return", "size"))
        .reset_index()
    )
    return points.sort_values(["task", "bits", "seed", "wall_seconds"], ascending=[True, False, True, True],
                              ignore_index=True)[columns]


def final_and_best_returns(evals: pd.DataFrame, policy: str = "fp32") -> Tuple[float, float]:
    """(final, best) mean evaluation return of `policy` in one run's eval.csv; NaN when it was never evaluated.

    Final is the shutdown evaluation (final=1), else the last periodic one; best is the highest of all.
    """
    # One run: the metadata columns eval_points groups by are constant here.
    frame = evals.assign(**{c: 0 for c in META_COLUMNS if c not in evals.columns})
    points = eval_points(frame, policy)
    if points.empty:
        return math.nan, math.nan
    ordered = points.sort_values(["final", "learner_steps"])
    return float(ordered["return"].iloc[-1]), float(points["return"].max())


def first_reach(x: Sequence[float], returns: Sequence[float], target: float) -> float:
    """The first x (in the order given) at which the return is at least `target`; NaN if it never is."""
    xs = np.asarray(x, dtype=float)
    ys = np.asarray(returns, dtype=float)
    if xs.shape != ys.shape:
        raise ValueError(f"x and returns differ in length: {xs.shape} vs {ys.shape}")
    hits = np.flatnonzero(ys >= target)
    return float(xs[hits[0]]) if hits.size else math.nan


def target_returns(points: pd.DataFrame, fraction: float = 0.9, target: Optional[float] = None) -> pd.Series:
    """Target return per task: `target` if given, else the best evaluation in the sweep less (1 - fraction) of its size."""
    if target is None and not 0.0 < fraction <= 1.0:
        raise ValueError(f"target fraction must be in (0, 1], got {fraction}")
    tasks = sorted(points["task"].unique()) if not points.empty else []
    if target is not None:
        return pd.Series({task: float(target) for task in tasks}, name="target", dtype=float)
    best = points.groupby("task")["return"].max()
    # best - (1 - f)|best| is f * best for positive returns and stays below the best for negative ones
    # (MountainCar, Acrobot), where f * best would be unreachable.
    return (best - (1.0 - fraction) * best.abs()).rename("target").astype(float)


def sweep_targets(evals: pd.DataFrame, fraction: float = 0.9, target: Optional[float] = None,
                  min_learner_steps: int = 1) -> pd.Series:
    """Target return per task from a sweep's evaluations, ignoring those before `min_learner_steps` learner steps."""
    points = eval_points(evals, "fp32")
    return target_returns(points[points["learner_steps"] >= min_learner_steps], fraction, target)


def run_time_to_target(points: pd.DataFrame, targets: pd.Series) -> pd.DataFrame:
    """Per run: the wall seconds and env steps at which its evaluation return first reached its task's target."""
    rows = []
    for (run, task, bits, seed), group in points.groupby(list(META_COLUMNS), sort=False):
        group = group.sort_values("wall_seconds")
        target = float(targets.get(task, math.nan))
        seconds = first_reach(group["wall_seconds"], group["return"], target)
        steps = first_reach(group["env_steps"], group["return"], target)
        rows.append({"run": run, "task": task, "bits": bits, "seed": seed, "target": target,
                     "time_to_target_s": seconds, "env_steps_to_target": steps, "reached": not math.isnan(seconds)})
    columns = ["run", "task", "bits", "seed", "target", "time_to_target_s", "env_steps_to_target", "reached"]
    return pd.DataFrame(rows, columns=columns)


def curve_band(points: pd.DataFrame, x: str = "wall_seconds", num: int = 200) -> pd.DataFrame:
    """Return against `x` per task and bit-width: mean, std, min and max over seeds on a shared grid.

    Each run's evaluations are interpolated linearly between its first and last
    evaluation and undefined outside them, so `n` says how many seeds a grid
    point averages.
    """
    _check_x(x)
    if num < 2:
        raise ValueError(f"num must be >= 2, got {num}")
    columns = ["task", "bits", x, "mean", "std", "min", "max", "n"]
    frames = []
    for (task, bits), group in points.groupby(["task", "bits"], sort=False):
        curves = []
        for _, run in group.groupby("run", sort=False):
            # Several evaluations can share an x (e.g. env steps at the final evaluation): keep the latest.
            run = run.sort_values("wall_seconds").groupby(x, sort=True)["return"].last()
            curves.append((run.index.to_numpy(dtype=float), run.to_numpy(dtype=float)))
        lo = min(c[0][0] for c in curves)
        hi = max(c[0][-1] for c in curves)
        grid = np.linspace(lo, hi, num) if hi > lo else np.array([lo])
        values = np.stack([np.interp(grid, xs, ys, left=np.nan, right=np.nan) for xs, ys in curves])
        n = np.sum(~np.isnan(values), axis=0)
        keep = n > 0
        values, grid, n = values[:, keep], grid[keep], n[keep]
        filled = np.where(np.isnan(values), 0.0, values)
        mean = filled.sum(axis=0) / n
        squares = np.where(np.isnan(values), 0.0, (values - mean) ** 2).sum(axis=0)
        # Sample std over the seeds present; a single seed has no spread.
        std = np.sqrt(squares / np.maximum(n - 1, 1)) * (n > 1)
        frames.append(pd.DataFrame({
            "task": task, "bits": bits, x: grid, "mean": mean, "std": std,
            "min": np.nanmin(values, axis=0), "max": np.nanmax(values, axis=0), "n": n,
        }))
    if not frames:
        return pd.DataFrame(columns=columns)
    return pd.concat(frames, ignore_index=True)[columns]


def _ratio(numerator: float, denominator: float) -> float:
    if math.isnan(numerator) or math.isnan(denominator) or denominator <= 0:
        return math.nan
    return numerator / denominator


def results_table(runs: pd.DataFrame, evals: pd.DataFrame, target_fraction: float = 0.9,
                  target: Optional[float] = None, baseline_bits: int = BASELINE_BITS,
                  min_learner_steps: int = 1) -> pd.DataFrame:
    """One row per task and bit-width: time to the target return, speedup and energy ratio against the baseline, final return.

    time_to_target_s and energy_to_target_wh are means over the runs that
    reached the target (`reached` of `runs`). A run's energy to target is its
    whole-run energy scaled by the share of its wall time spent before the
    target (constant power assumed). speedup = baseline time / this time and
    energy_ratio = baseline energy / this energy, so above 1 is better.
    Evaluations before `min_learner_steps` (by default the untrained policy,
    which scores well on some tasks by luck) count neither for the target nor
    for reaching it.
    """
    points = eval_points(evals, "fp32")
    points = points[points["learner_steps"] >= min_learner_steps]
    targets = sweep_targets(evals, target_fraction, target, min_learner_steps)
    reach = run_time_to_target(points, targets)
    merged = runs.merge(reach[["run", "target", "time_to_target_s", "env_steps_to_target", "reached"]],
                        on="run", how="left")
    merged["reached"] = merged["reached"].astype("boolean").fillna(False).astype(bool)
    merged["energy_to_target_wh"] = 1000.0 * merged["energy_kwh"] * merged["time_to_target_s"] / merged["wall_seconds"]
    rows = []
    for (task, bits), group in merged.groupby(["task", "bits"], sort=False):
        hit = group[group["reached"]]
        rows.append({
            "task": task,
            "bits": int(bits),
            "runs": len(group),
            "reached": int(len(hit)),
            "target": float(targets.get(task, math.nan)),
            "time_to_target_s": hit["time_to_target_s"].mean() if len(hit) else math.nan,
            "env_steps_to_target": hit["env_steps_to_target"].mean() if len(hit) else math.nan,
            "energy_to_target_wh": hit["energy_to_target_wh"].mean() if len(hit) else math.nan,
            "env_steps_per_second": group["env_steps_per_second"].mean(),
            "energy_kwh": group["energy_kwh"].mean(),
            "final_return": group["final_eval_return"].mean(),
            "final_return_std": group["final_eval_return"].std(ddof=1) if len(group) > 1 else 0.0,
            "final_return_actor": group["final_eval_return_actor_policy"].mean(),
        })
    columns = ["task", "bits", "runs", "reached", "target", "time_to_target_s", "speedup", "env_steps_to_target",
               "energy_to_target_wh", "energy_ratio", "env_steps_per_second", "energy_kwh", "final_return",
               "final_return_std", "final_return_actor"]
    table = pd.DataFrame(rows)
    if table.empty:
        return pd.DataFrame(columns=columns)
    baseline: Dict[str, pd.Series] = {
        task: group.iloc[0] for task, group in table[table["bits"] == baseline_bits].groupby("task")
    }
    table["speedup"] = [
        _ratio(baseline[t]["time_to_target_s"], s) if t in baseline else math.nan
        for t, s in zip(table["task"], table["time_to_target_s"])
    ]
    table["energy_ratio"] = [
        _ratio(baseline[t]["energy_to_target_wh"], e) if t in baseline else math.nan
        for t, e in zip(table["task"], table["energy_to_target_wh"])
    ]
    return table.sort_values(["task", "bits"], ascending=[True, False], ignore_index=True)[columns]


def actor_time_breakdown(actors: pd.DataFrame) -> pd.DataFrame:
    """Actor milliseconds per env step in each phase, per task and bit-width (mean over runs), from actor episodes."""
    phase_columns = [f"{p}_ms" for p in PHASES]
    columns = ["task", "bits", "runs", "actor_steps"] + phase_columns + ["total_ms"]
    if actors.empty or "episode_length" not in actors.columns:
        return pd.DataFrame(columns=columns)
    # Runs written before a phase existed (rate_limit_wait came later) count it as zero.
    actors = actors.reindex(columns=list(dict.fromkeys([*actors.columns, *(f"{p}_s" for p in PHASES)])), fill_value=0.0)
    sums = actors.groupby(list(META_COLUMNS), sort=False)[["episode_length"] + [f"{p}_s" for p in PHASES]].sum()
    sums = sums[sums["episode_length"] > 0]
    per_run = pd.DataFrame({f"{p}_ms": 1000.0 * sums[f"{p}_s"] / sums["episode_length"] for p in PHASES})
    per_run["actor_steps"] = sums["episode_length"]
    per_run = per_run.reset_index()
    grouped = per_run.groupby(["task", "bits"], sort=False)
    table = grouped[phase_columns + ["actor_steps"]].mean()
    table["runs"] = grouped.size()
    table["total_ms"] = table[phase_columns].sum(axis=1)
    table = table.reset_index()
    table["actor_steps"] = table["actor_steps"].round().astype(int)
    return table.sort_values(["task", "bits"], ascending=[True, False], ignore_index=True)[columns]
