"""Aggregations of loaded runs: evaluation curves, bands over seeds, time to target, speedup, actor time.

Time to target has one definition, `time_to_target`, used by the sweep tables,
benchmarks/end_to_end.py, experiments/demo.py and the notebook:

- an evaluation is one evaluation round of the fp32 (learner's) policy; its
  return is the mean over its episodes, and an evaluation with a NaN episode
  return has a NaN return, which reaches no target;
- evaluations of the untrained policy (learner step 0 by default) do not count;
- the run reaches the target at the first evaluation, in wall-clock order, whose
  return is >= the target; the final (shutdown) evaluation counts like any other;
- a run that never reaches it has NaN time, env steps and energy to target and
  counts as "not reached" (never as its budget): means over runs are means over
  the runs that reached it, reported beside how many did.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple

import numpy as np
import pandas as pd

from actorq_jax.analysis.loading import META_COLUMNS, PHASES

X_COLUMNS = ("wall_seconds", "env_steps", "learner_steps")
BASELINE_BITS = 32


def _check_x(x: str) -> None:
    if x not in X_COLUMNS:
        raise ValueError(f"x must be one of {X_COLUMNS}, got {x!r}")


def _mean_keeping_nan(values: pd.Series) -> float:
    # A NaN episode makes its evaluation NaN: a diverged policy must not pass on its finite episodes.
    return float(values.mean(skipna=False))


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
             **{"return": ("return", _mean_keeping_nan)}, episodes=("return", "size"))
        .reset_index()
    )
    return points.sort_values(["task", "bits", "seed", "wall_seconds"], ascending=[True, False, True, True],
                              ignore_index=True)[columns]


def final_and_best_returns(evals: pd.DataFrame, policy: str = "fp32") -> Tuple[float, float]:
    """(final, best) mean evaluation return of `policy` in one run's eval.csv; NaN when it was never evaluated.

    Final is the shutdown evaluation (final=1), else the last periodic one; best is the highest of those
    after at least one SGD step (NaN without one), as in `time_to_target`: the untrained policy's
    evaluation at step 0 says nothing of training, and a lucky one would stand as a run's best.
    """
    # One run: the metadata columns eval_points groups by are constant here.
    frame = evals.assign(**{c: 0 for c in META_COLUMNS if c not in evals.columns})
    points = eval_points(frame, policy)
    if points.empty:
        return math.nan, math.nan
    ordered = points.sort_values(["final", "learner_steps"])
    trained = points[points["learner_steps"] >= 1]
    return float(ordered["return"].iloc[-1]), float(trained["return"].max()) if len(trained) else math.nan


@dataclasses.dataclass(frozen=True)
class TargetReach:
    """Where one run first reached a target return: the evaluation's wall seconds, env and learner steps, return."""

    reached: bool
    wall_seconds: float
    env_steps: float
    learner_steps: float
    eval_return: float


def time_to_target(evals: pd.DataFrame, target: float, min_learner_steps: int = 1) -> TargetReach:
    """The first fp32 evaluation of one run whose mean return is >= target (final included); NaN fields on a miss.

    `evals` holds one run's eval.csv rows (columns policy, learner_steps, final,
    wall_seconds, env_steps, return). The full definition is in this module's
    docstring.
    """
    missing = {"policy", "learner_steps", "final", "wall_seconds", "env_steps", "return"} - set(evals.columns)
    if missing and not evals.empty:
        raise ValueError(f"eval rows lack columns {sorted(missing)}")
    # Only `run` tells runs apart: a raw eval.csv's `bits` is the evaluated policy's, not the run's.
    if "run" in evals.columns and evals["run"].nunique() > 1:
        raise ValueError("time_to_target takes the evaluations of one run; use run_time_to_target for several")
    miss = TargetReach(False, math.nan, math.nan, math.nan, math.nan)
    if evals.empty or math.isnan(float(target)):
        return miss
    frame = evals.assign(**{c: 0 for c in META_COLUMNS if c not in evals.columns})
    points = eval_points(frame, "fp32")
    points = points[points["learner_steps"] >= min_learner_steps]
    points = points.sort_values(["wall_seconds", "final"], kind="stable")
    hits = points[points["return"] >= target]  # NaN >= target is False
    if hits.empty:
        return miss
    first = hits.iloc[0]
    return TargetReach(True, float(first["wall_seconds"]), float(first["env_steps"]), float(first["learner_steps"]),
                       float(first["return"]))


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


def run_time_to_target(evals: pd.DataFrame, targets: pd.Series, min_learner_steps: int = 1) -> pd.DataFrame:
    """Per run (rows of `evals` grouped by run): `time_to_target` against its task's target in `targets`."""
    columns = ["run", "task", "bits", "seed", "target", "time_to_target_s", "env_steps_to_target", "reached"]
    if evals.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for (run, task, bits, seed), group in evals.groupby(list(META_COLUMNS), sort=False):
        target = float(targets.get(task, math.nan))
        reach = time_to_target(group, target, min_learner_steps)
        rows.append({"run": run, "task": task, "bits": bits, "seed": seed, "target": target,
                     "time_to_target_s": reach.wall_seconds, "env_steps_to_target": reach.env_steps,
                     "reached": reach.reached})
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
    reached the target (`time_to_target`; `reached` of `runs`). A run's energy to target is its
    whole-run energy scaled by the share of its wall time spent before the
    target (constant power assumed). speedup = baseline time / this time and
    energy_ratio = baseline energy / this energy, so above 1 is better.
    Evaluations before `min_learner_steps` (by default the untrained policy,
    which scores well on some tasks by luck) count neither for the target nor
    for reaching it.
    """
    targets = sweep_targets(evals, target_fraction, target, min_learner_steps)
    reach = run_time_to_target(evals, targets, min_learner_steps)
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


def _std(values: pd.Series) -> float:
    finite = values.dropna()
    return float(finite.std(ddof=1)) if len(finite) > 1 else math.nan


def bits_table(runs: pd.DataFrame, evals: pd.DataFrame) -> pd.DataFrame:
    """Per agent, task and actor bit-width, over finished runs: final and best return, fp32 and actors' policy.

    Final is the shutdown evaluation's mean return (else the last periodic one),
    best the highest evaluation's (`final_and_best_returns`); each is given as
    the mean, sample std and min/max over seeds. Runs without summary.json
    (still going, or killed) are left out.
    """
    columns = ["agent", "task", "bits", "seeds", "final", "final_std", "final_min", "final_max", "best", "best_std",
               "best_min", "best_max", "actor_final", "actor_final_std", "actor_best", "actor_best_std"]
    done = runs[runs["complete"].astype(bool)] if not runs.empty else runs
    rows = []
    for run in done.itertuples(index=False):
        run_evals = evals[evals["run"] == run.run] if not evals.empty else evals
        final, best = final_and_best_returns(run_evals, "fp32")
        actor_final, actor_best = final_and_best_returns(run_evals, "actor")
        rows.append({"agent": run.agent, "task": run.task, "bits": int(run.bits), "final": final, "best": best,
                     "actor_final": actor_final, "actor_best": actor_best})
    if not rows:
        return pd.DataFrame(columns=columns)
    per_run = pd.DataFrame(rows)
    out = []
    for (agent, task, bits), group in per_run.groupby(["agent", "task", "bits"], sort=False):
        out.append({
            "agent": agent, "task": task, "bits": int(bits), "seeds": len(group),
            "final": group["final"].mean(), "final_std": _std(group["final"]),
            "final_min": group["final"].min(), "final_max": group["final"].max(),
            "best": group["best"].mean(), "best_std": _std(group["best"]),
            "best_min": group["best"].min(), "best_max": group["best"].max(),
            "actor_final": group["actor_final"].mean(), "actor_final_std": _std(group["actor_final"]),
            "actor_best": group["actor_best"].mean(), "actor_best_std": _std(group["actor_best"]),
        })
    table = pd.DataFrame(out, columns=columns)
    return table.sort_values(["agent", "task", "bits"], ascending=[True, True, False], ignore_index=True)


def fewest_bits_within(table: pd.DataFrame, tolerance: float = 0.05,
                       baseline_bits: int = BASELINE_BITS) -> Dict[Tuple[str, str], Optional[int]]:
    """Per (agent, task) of `bits_table`: the fewest bits whose mean final return is >= q=32's less `tolerance` of its size.

    None where no bit-width below the baseline is within it, or there is no
    baseline run to compare with.
    """
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    answer: Dict[Tuple[str, str], Optional[int]] = {}
    for (agent, task), group in table.groupby(["agent", "task"], sort=True):
        base = group.loc[group["bits"] == baseline_bits, "final"]
        if base.empty or math.isnan(float(base.iloc[0])):
            answer[(agent, task)] = None
            continue
        floor = float(base.iloc[0]) - tolerance * abs(float(base.iloc[0]))
        within = group[(group["bits"] < baseline_bits) & (group["final"] >= floor)]
        answer[(agent, task)] = int(within["bits"].min()) if not within.empty else None
    return answer
