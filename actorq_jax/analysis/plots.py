"""Figures of a sweep: return against wall time or env steps per bit-width, actor time breakdown, PTQ return against bits.

Figures are built as `matplotlib.figure.Figure` objects without pyplot, so a
script needs no display and repeated calls hold no global state; a notebook
shows them with `display(fig)` (or as a cell's last value).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from actorq_jax.analysis.aggregate import curve_band

# Fixed colours so a bit-width looks the same in every figure.
_BIT_COLORS = {32: "tab:blue", 16: "tab:orange", 8: "tab:green", 7: "tab:olive", 6: "tab:cyan", 5: "tab:pink",
               4: "tab:red", 3: "tab:purple", 2: "tab:brown"}
PHASE_COLORS = {"env_step": "#4c72b0", "inference": "#dd8452", "adder": "#937860", "rate_limit_wait": "#c8c8c8",
                 "pull": "#55a868", "deserialize": "#c44e52", "load": "#8172b3"}
_X_LABELS = {"wall_seconds": "wall-clock time (s)", "env_steps": "environment steps",
             "learner_steps": "learner steps"}
BANDS = ("minmax", "std")


def bits_color(bits: int) -> str:
    """The colour of a bit-width in every figure."""
    return _BIT_COLORS.get(int(bits), "black")


def _tasks(frame: pd.DataFrame) -> list:
    return sorted(frame["task"].unique()) if not frame.empty else []


def plot_return_curves(points: pd.DataFrame, x: str = "wall_seconds", targets: Optional[pd.Series] = None,
                       actor_points: Optional[pd.DataFrame] = None, band: str = "minmax",
                       policy_label: str = "fp32 policy") -> Figure:
    """Evaluation return against `x`, one panel per task, one line per bit-width with a band over seeds.

    `band` is "minmax" (range over seeds) or "std" (mean +- sample std).
    `actor_points`, when given, adds the actors' quantized policy as dashed
    mean lines; `targets` (per task) draws the target return.
    """
    if band not in BANDS:
        raise ValueError(f"band must be one of {BANDS}, got {band!r}")
    tasks = _tasks(points)
    if not tasks:
        raise ValueError("no evaluation points to plot")
    fig = Figure(figsize=(6.0 * len(tasks), 4.2), layout="constrained")
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    curves = curve_band(points, x)
    actor_curves = curve_band(actor_points, x) if actor_points is not None and not actor_points.empty else None
    for ax, task in zip(axes, tasks):
        for bits in sorted(curves.loc[curves["task"] == task, "bits"].unique(), reverse=True):
            curve = curves[(curves["task"] == task) & (curves["bits"] == bits)]
            seeds = points.loc[(points["task"] == task) & (points["bits"] == bits), "seed"].nunique()
            color = bits_color(bits)
            ax.plot(curve[x], curve["mean"], color=color, label=f"q={bits} ({seeds} seed{'s' * (seeds != 1)})")
            lo, hi = (curve["min"], curve["max"]) if band == "minmax" else (
                curve["mean"] - curve["std"], curve["mean"] + curve["std"])
            ax.fill_between(curve[x], lo, hi, color=color, alpha=0.18, linewidth=0)
            if actor_curves is not None and bits != 32:
                actor = actor_curves[(actor_curves["task"] == task) & (actor_curves["bits"] == bits)]
                if not actor.empty:
                    ax.plot(actor[x], actor["mean"], color=color, linestyle="--", linewidth=1.0,
                            label=f"q={bits} actors' policy")
        if targets is not None and task in targets.index and np.isfinite(targets[task]):
            ax.axhline(targets[task], color="grey", linestyle=":", linewidth=1.0, label=f"target {targets[task]:.0f}")
        ax.set_title(task)
        ax.set_xlabel(_X_LABELS[x])
        ax.set_ylabel(f"evaluation return ({policy_label})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    band_text = "range over seeds" if band == "minmax" else "+-std over seeds"
    fig.suptitle(f"Line: mean over seeds; band: {band_text}", fontsize="small")
    return fig


# Stacking order: the actor's own work first, then the time Reverb's rate limiter held it (waiting on the learner).
_STACK = ("env_step", "inference", "adder", "pull", "deserialize", "load", "rate_limit_wait")
_WAIT_PHASES = ("rate_limit_wait",)


def plot_actor_time(breakdown: pd.DataFrame) -> Figure:
    """Stacked bars of actor time per env step by phase and bit-width: ms per step (left), share without the wait (right).

    `rate_limit_wait` is time blocked by Reverb's rate limiter (waiting for the
    learner), so the right panel shows how the actor's own work splits.
    """
    tasks = _tasks(breakdown)
    if not tasks:
        raise ValueError("no actor episodes to plot")
    fig = Figure(figsize=(11.0, 3.8 * len(tasks)), layout="constrained")
    axes = fig.subplots(len(tasks), 2, squeeze=False)
    for (ax_ms, ax_share), task in zip(axes, tasks):
        rows = breakdown[breakdown["task"] == task].sort_values("bits", ascending=False)
        labels = [f"q={b}" for b in rows["bits"]]
        positions = np.arange(len(rows))
        work = [p for p in _STACK if p not in _WAIT_PHASES]
        totals = rows[[f"{p}_ms" for p in work]].fillna(0.0).sum(axis=1).to_numpy()
        bottom_ms = np.zeros(len(rows))
        bottom_share = np.zeros(len(rows))
        for phase in _STACK:
            ms = rows[f"{phase}_ms"].fillna(0.0).to_numpy()
            color = PHASE_COLORS[phase]
            label = "replay write" if phase == "adder" else phase.replace("_", " ")
            ax_ms.bar(positions, ms, bottom=bottom_ms, color=color, label=label)
            bottom_ms += ms
            if phase in work:
                share = np.divide(100.0 * ms, totals, out=np.zeros_like(ms), where=totals > 0)
                ax_share.bar(positions, share, bottom=bottom_share, color=color)
                bottom_share += share
        for ax in (ax_ms, ax_share):
            ax.set_xticks(positions, labels)
            ax.grid(axis="y", alpha=0.3)
        ax_ms.set_ylabel("ms per actor env step")
        ax_ms.set_title(f"{task}: actor time per step")
        ax_share.set_ylabel("% of actor time without the rate-limit wait")
        ax_share.set_ylim(0, 100)
        ax_share.set_title(f"{task}: share of the actor's own work")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(_STACK), fontsize="small")
    return fig


def plot_ptq(ptq: pd.DataFrame, title: str = "") -> Figure:
    """Return of a trained policy quantized after training, against bits: mean line, +-std band, min-max bars."""
    if ptq.empty:
        raise ValueError("no post-training quantization results to plot")
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for i, (granularity, rows) in enumerate(ptq.groupby("granularity", sort=True)):
        rows = rows.sort_values("bits")
        bits = rows["bits"].to_numpy(dtype=float)
        mean = rows["mean_return"].to_numpy(dtype=float)
        std = rows["std_return"].fillna(0.0).to_numpy(dtype=float)
        color = f"C{i}"
        ax.plot(bits, mean, marker="o", color=color, label=f"{granularity} (mean)")
        ax.fill_between(bits, mean - std, mean + std, color=color, alpha=0.18, linewidth=0)
        ax.errorbar(bits, mean, yerr=[mean - rows["min_return"], rows["max_return"] - mean], fmt="none",
                    ecolor=color, alpha=0.6, capsize=3)
    ax.set_xscale("log", base=2)
    ticks = sorted(ptq["bits"].unique())
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.minorticks_off()
    ax.set_xlabel("policy bits (quantized after training)")
    ax.set_ylabel("greedy episode return")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title or "Post-training quantization: return against bits (band: +-std, bars: min-max)",
                 fontsize="medium")
    return fig


def plot_return_vs_bits(table: pd.DataFrame) -> Figure:
    """Final and best fp32 return against actor bits (mean over seeds, bars min-max), one panel per agent and task.

    `table` is `bits_table`'s; the actors' own-precision final return is drawn dashed.
    """
    if table.empty:
        raise ValueError("no finished runs to plot")
    groups = list(table.groupby(["agent", "task"], sort=True))
    fig = Figure(figsize=(5.5 * len(groups), 4.2), layout="constrained")
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, ((agent, task), rows) in zip(axes, groups):
        rows = rows.sort_values("bits")
        bits = rows["bits"].to_numpy(dtype=float)
        for column, label, color, offset in (("final", "final", "tab:blue", 0.97), ("best", "best", "tab:green", 1.03)):
            mean = rows[column].to_numpy(dtype=float)
            yerr = [mean - rows[f"{column}_min"].to_numpy(dtype=float), rows[f"{column}_max"].to_numpy(dtype=float) - mean]
            ax.errorbar(bits * offset, mean, yerr=yerr, marker="o", color=color, capsize=3,
                        label=f"{label} return, fp32 policy")
        actor = rows[rows["actor_final"].notna()]
        if not actor.empty:
            ax.plot(actor["bits"].to_numpy(dtype=float), actor["actor_final"].to_numpy(dtype=float), marker="x",
                    linestyle="--", color="tab:red", label="final return, actors' own precision")
        ax.set_xscale("log", base=2)
        ticks = sorted(int(b) for b in rows["bits"].unique())
        ax.set_xticks(ticks, [str(b) for b in ticks])
        ax.minorticks_off()
        seeds = ", ".join(f"q{int(b)}: {int(n)}" for b, n in zip(rows["bits"], rows["seeds"]))
        ax.set_title(f"{agent} {task}\nseeds {seeds}", fontsize="small")
        ax.set_xlabel("actor bits during training")
        ax.set_ylabel("evaluation return (mean over seeds; bars: min-max)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def save_figure(fig: Figure, path: Union[str, Path], dpi: int = 120) -> Path:
    """Writes a figure as PNG (creating the folder) and returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, metadata={"Software": None})  # no version stamp: same data, same bytes
    return path


__all__: Sequence[str] = ("bits_color", "plot_return_curves", "plot_actor_time", "plot_ptq", "plot_return_vs_bits",
                          "save_figure")
