"""The results table in readable form (markdown) and the whole report of a sweep: PNG figures plus results.md."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import pandas as pd

from actorq_jax.analysis.aggregate import (
    BASELINE_BITS,
    actor_time_breakdown,
    eval_points,
    fewest_bits_within,
    results_table,
    sweep_targets,
)
from actorq_jax.analysis.loading import Sweep
from actorq_jax.analysis.plots import plot_actor_time, plot_return_curves, save_figure

# Column -> (header, format) of the readable table.
_DISPLAY = {
    "task": ("task", "{}"),
    "bits": ("bits", "q={}"),
    "reached": ("reached", None),
    "target": ("target return", "{:.1f}"),
    "time_to_target_s": ("time to target (s)", "{:.0f}"),
    "speedup": ("speedup vs q32", "{:.2f}x"),
    "env_steps_to_target": ("env steps to target", "{:,.0f}"),
    "energy_to_target_wh": ("energy to target (Wh)", "{:.3f}"),
    "energy_ratio": ("energy ratio q32/q", "{:.2f}x"),
    "env_steps_per_second": ("env steps/s", "{:.0f}"),
    "final_return": ("final return (fp32)", None),
    "final_return_actor": ("final return (actors' policy)", "{:.1f}"),
}
FIGURES = {
    "return_vs_wall_time": "return_vs_wall_time.png",
    "return_vs_env_steps": "return_vs_env_steps.png",
    "actor_time_breakdown": "actor_time_breakdown.png",
}


def _fmt(value: object, pattern: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """The results table as strings with readable headers and units (NaN shown as '-')."""
    out = {}
    for column, (header, pattern) in _DISPLAY.items():
        if column == "reached":
            out[header] = [f"{r}/{n}" for r, n in zip(table["reached"], table["runs"])]
        elif column == "final_return":
            out[header] = [
                _fmt(m, "{:.1f}") + ("" if n < 2 or math.isnan(s) else f" +- {s:.1f}")
                for m, s, n in zip(table["final_return"], table["final_return_std"], table["runs"])
            ]
        else:
            out[header] = [_fmt(v, pattern) for v in table[column]]
    return pd.DataFrame(out, index=range(len(table)))


def to_markdown(frame: pd.DataFrame) -> str:
    """A DataFrame as a GitHub markdown table (cells as str; '|' escaped)."""
    def cell(value: object) -> str:
        return str(value).replace("|", "\\|")

    header = [cell(c) for c in frame.columns]
    rows = [[cell(v) for v in row] for row in frame.itertuples(index=False)]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |" for row in rows]
    return "\n".join(lines)


def describe_target(target_fraction: float, target: Optional[float]) -> str:
    """One sentence saying how the target return was chosen."""
    if target is not None:
        return f"Target return: {target:g} (given)."
    return (f"Target return per task: {target_fraction:g} of the best fp32 evaluation return reached anywhere in "
            f"the sweep (best - {1 - target_fraction:.2g} x |best|); evaluations of the untrained policy "
            "(learner step 0) count neither for the best nor for reaching the target.")


def results_markdown(table: pd.DataFrame, target_fraction: float, target: Optional[float] = None,
                     sweep: Optional[Sweep] = None, figures: Sequence[str] = ()) -> str:
    """The results.md text: what was compared, how, the table per task, and the figures."""
    lines: List[str] = ["# ActorQ sweep results", ""]
    if sweep is not None:
        lines += [f"Sweep: `{sweep.path}` ({len(sweep.runs)} runs; "
                  f"{int(sweep.runs['complete'].sum())} complete).", ""]
        command = sweep.index.get("command")
        if command:
            lines += [f"Command: `{command}`", ""]
    lines += [
        describe_target(target_fraction, target),
        "Time to target and its energy are means over the runs that reached it (`reached`); "
        "energy to target is the run's energy times the share of its wall time before the target. "
        "Speedup and energy ratio compare with q=32 (above 1: faster, less energy). "
        "Final return: the last evaluation's mean (+- std over seeds).",
        "",
    ]
    if table.empty:
        lines += ["No runs with evaluations yet.", ""]
    for task, rows in table.groupby("task", sort=True):
        lines += [f"## {task}", "", to_markdown(display_table(rows.reset_index(drop=True)).drop(columns="task")), ""]
    for name in figures:
        lines += [f"![{Path(name).stem}]({name})", ""]
    return "\n".join(lines)


def _mean_std(mean: float, std: float, seeds: int) -> str:
    if mean is None or math.isnan(mean):
        return "-"
    return f"{mean:.1f}" if seeds < 2 or std is None or math.isnan(std) else f"{mean:.1f} ± {std:.1f}"


def bits_markdown(table: pd.DataFrame, tolerance: float = 0.05, baseline_bits: int = BASELINE_BITS) -> str:
    """`bits_table` as markdown: returns per bit-width (mean ± std over seeds), then the fewest bits within tolerance."""
    if table.empty:
        return "No finished runs yet."
    rows = []
    for r in table.itertuples(index=False):
        same = int(r.bits) == baseline_bits
        rows.append({
            "agent": r.agent, "task": r.task, "actor bits": f"q={int(r.bits)}", "seeds": str(int(r.seeds)),
            "final return (fp32 policy)": _mean_std(r.final, r.final_std, r.seeds),
            "best return (fp32 policy)": _mean_std(r.best, r.best_std, r.seeds),
            "final return (actors' precision)": "= fp32" if same else _mean_std(r.actor_final, r.actor_final_std, r.seeds),
            "best return (actors' precision)": "= fp32" if same else _mean_std(r.actor_best, r.actor_best_std, r.seeds),
        })
    fewest = fewest_bits_within(table, tolerance, baseline_bits)
    answer = []
    for (agent, task), bits in fewest.items():
        base = table[(table["agent"] == agent) & (table["task"] == task) & (table["bits"] == baseline_bits)]
        answer.append({
            "agent": agent, "task": task,
            f"q={baseline_bits} final (fp32 policy)": _mean_std(base["final"].iloc[0], math.nan, 1) if len(base) else "-",
            f"fewest bits with final return within {tolerance:.0%} of q={baseline_bits}'s":
                "no q=32 run yet" if base.empty else ("none" if bits is None else f"q={bits}"),
        })
    return to_markdown(pd.DataFrame(rows)) + "\n\n" + to_markdown(pd.DataFrame(answer))


def write_report(sweep: Sweep, out_dir: Union[str, Path], target_fraction: float = 0.9,
                 target: Optional[float] = None) -> Dict[str, Path]:
    """Writes the sweep's figures (PNG) and results.md into `out_dir`; returns their paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fp32 = eval_points(sweep.evals, "fp32")
    if fp32.empty:
        raise ValueError(f"no fp32 evaluations in {sweep.path}: nothing to plot")
    actor = eval_points(sweep.evals, "actor")
    targets = sweep_targets(sweep.evals, target_fraction, target)
    written: Dict[str, Path] = {}
    written["return_vs_wall_time"] = save_figure(
        plot_return_curves(fp32, "wall_seconds", targets=targets, actor_points=actor),
        out / FIGURES["return_vs_wall_time"])
    written["return_vs_env_steps"] = save_figure(
        plot_return_curves(fp32, "env_steps", targets=targets, actor_points=actor),
        out / FIGURES["return_vs_env_steps"])
    breakdown = actor_time_breakdown(sweep.actors)
    if not breakdown.empty:
        written["actor_time_breakdown"] = save_figure(plot_actor_time(breakdown), out / FIGURES["actor_time_breakdown"])
    table = results_table(sweep.runs, sweep.evals, target_fraction, target)
    markdown = results_markdown(table, target_fraction, target, sweep, [p.name for p in written.values()])
    written["results_md"] = out / "results.md"
    written["results_md"].write_text(markdown + "\n")
    written["results_csv"] = out / "results.csv"
    table.to_csv(written["results_csv"], index=False)
    return written
