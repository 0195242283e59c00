"""Where the time of a run goes (RQ4): actor milliseconds per env step by phase, learner milliseconds per SGD
step (CPU against the rest), per agent, task, layout, actor layout, replay regime, machine, actor and wire
bit-width; and its figure.

The actor's phases are wall time, each beside the CPU time its thread spent: wall well above CPU means
the process waited (for a core, the server, or the rate limiter). The learner's step splits into its
thread's CPU and the rest (sampling held by the rate limiter, or the process waiting for a core).
"""

from __future__ import annotations

import json
import math
import re
from typing import Dict, List, Optional

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from actorq_jax.analysis.loading import PHASES
from actorq_jax.analysis.plots import PHASE_COLORS
from actorq_jax.analysis.run_figures import bottleneck, core_load
from actorq_jax.run_dir import RunDir
from actorq_jax.telemetry.schema import CPU_CLOCK

# Runs of different machines are never averaged together: the same layout is another balance on another CPU.
GROUP = ["agent", "task", "layout", "actors", "policy", "regime", "machine", "bits", "comm_bits"]
UNRECORDED = "not recorded"


def _phase_seconds(episodes: pd.DataFrame, suffix: str = "_s") -> Dict[str, float]:
    """Each phase's seconds (wall, or CPU with suffix "_cpu_s") over one run's actor episodes (a phase a run did
    not time counts zero)."""
    return {p: float(episodes[f"{p}{suffix}"].fillna(0.0).sum()) if f"{p}{suffix}" in episodes.columns else 0.0
            for p in PHASES}


def _bound(group: pd.DataFrame) -> str:
    """What bound a group's runs, from their summed actor phases (their CPU too where every run has it) and
    the actors' cores' load averaged over runs (where every run has it)."""
    wall = {p: sum(s[p] for s in group["phase_s"]) for p in PHASES}
    cpus = list(group["phase_cpu_s"])
    cpu = {p: sum(c[p] for c in cpus) for p in PHASES} if all(c is not None for c in cpus) else None
    loads = list(group["core_load"])
    load = None
    if all(loads):
        keys = set().union(*loads)
        load = {k: sum(x.get(k, 0.0) for x in loads) / len(loads) for k in keys}
    return bottleneck(wall, cpu, load)


def _core_load(run_dir: str, cores: Optional[int]) -> Optional[Dict[str, float]]:
    """run_figures.core_load of one run directory (None where it lacks the figures)."""
    run_dir_ = RunDir(run_dir)
    try:
        summary, config = json.loads(run_dir_.summary.read_text()), json.loads(run_dir_.config.read_text())
    except (OSError, ValueError):
        return None
    return core_load(summary, config.get("run", {}), cores)


def _actor_split(episodes: pd.DataFrame, phase_s: Dict[str, float]) -> Dict[str, float]:
    """ms per env step of one run's actors: each phase's wall time, and the CPU time of all phases together."""
    steps = float(episodes["episode_length"].sum())
    split = {f"actor_{p}_ms": 1000.0 * phase_s[p] / steps for p in PHASES}
    cpu = [f"{p}_cpu_s" for p in PHASES if f"{p}_cpu_s" in episodes.columns]
    split["actor_cpu_ms"] = 1000.0 * float(episodes[cpu].fillna(0.0).to_numpy().sum()) / steps if cpu else math.nan
    split["actor_wall_ms"] = sum(split[f"actor_{p}_ms"] for p in PHASES)
    return split


def _learner_split(rows: pd.DataFrame) -> Dict[str, float]:
    """ms per SGD step of one run's learner after its first logged row (compilation and warm-up excluded)."""
    rows = rows.sort_values("learner_steps")
    if len(rows) < 2:
        return {"learner_wall_ms": math.nan, "learner_cpu_ms": math.nan}
    first, last = rows.iloc[0], rows.iloc[-1]
    steps = float(last["learner_steps"] - first["learner_steps"])
    wall = 1000.0 * float(last["wall_seconds"] - first["wall_seconds"]) / steps if steps > 0 else math.nan
    later = rows.iloc[1:]
    cpu = 1000.0 * float(later["cpu_s_per_step"].mean()) if "cpu_s_per_step" in later.columns else math.nan
    return {"learner_wall_ms": wall, "learner_cpu_ms": cpu}


def time_split(runs: pd.DataFrame, actors: pd.DataFrame, learner: pd.DataFrame,
               cores: Optional[int] = None) -> pd.DataFrame:
    """One row per (agent, task, layout, actor layout, policy, regime, machine, actor bits, wire bits): mean over runs
    of the actors' and the learner's ms per step, with the run count and what bound the runs (from the summed actor phases and,
    where measured, the actors' cores' load; `cores`: the machine's, for runs that did not record theirs)."""
    rows: List[Dict[str, object]] = []
    for run in runs[runs["complete"]].itertuples(index=False):
        episodes = actors[actors["run"] == run.run] if not actors.empty else actors
        if episodes.empty or float(episodes["episode_length"].sum()) <= 0:
            continue
        row = {k: getattr(run, k) for k in GROUP if k != "machine"}
        machine = getattr(run, "machine", None)
        row["machine"] = machine if isinstance(machine, str) and machine else UNRECORDED
        row["phase_s"] = _phase_seconds(episodes)
        # CPU per phase only from the process clock (one thread's clock missed XLA's threads).
        row["phase_cpu_s"] = _phase_seconds(episodes, "_cpu_s") if run.cpu_clock == CPU_CLOCK else None
        run_dir = getattr(run, "run_dir", None)
        row["core_load"] = _core_load(run_dir, cores) if isinstance(run_dir, str) else None
        row.update(_actor_split(episodes, row["phase_s"]))
        row.update(_learner_split(learner[learner["run"] == run.run] if not learner.empty else learner))
        # What serving the actors and the learner cost the replay service, per env step (not an actor phase).
        service_s, env_steps = getattr(run, "replay_cpu_s", math.nan), getattr(run, "env_steps", math.nan)
        row["service_cpu_ms"] = 1000.0 * service_s / env_steps if env_steps and env_steps == env_steps else math.nan
        if run.cpu_clock != CPU_CLOCK:  # an older run timed one thread only, missing XLA's: no CPU figure
            row["actor_cpu_ms"] = row["learner_cpu_ms"] = math.nan
        rows.append(row)
    columns = GROUP + ["runs"] + [f"actor_{p}_ms" for p in PHASES] + [
        "actor_wall_ms", "actor_cpu_ms", "service_cpu_ms", "learner_wall_ms", "learner_cpu_ms", "bound_by"]
    if not rows:
        return pd.DataFrame(columns=columns)
    frame = pd.DataFrame(rows)
    numeric = [c for c in columns if c.endswith("_ms")]
    grouped = frame.groupby(GROUP, sort=False)
    table = grouped[numeric].mean()
    table["runs"] = grouped.size()
    table["bound_by"] = grouped[["phase_s", "phase_cpu_s", "core_load"]].apply(_bound)
    table = table.reset_index()
    order = table.sort_values(GROUP, ascending=[True] * (len(GROUP) - 2) + [False, False])
    return order.reset_index(drop=True)[columns]


def _or_dash(value: float, pattern: str) -> str:
    return "-" if value != value else format(value, pattern)


def time_split_markdown(table: pd.DataFrame) -> str:
    """The table of record: ms per step by phase (actors) and CPU against the rest (learner), and the bound."""
    header = (["agent", "task", "layout", "actors", "policy", "regime", "machine", "actor bits", "wire bits", "runs"]
              + [p.replace("_", " ") for p in PHASES]
              + ["actor wall (CPU)", "replay service CPU", "learner step wall (CPU)", "bound by"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in table.itertuples(index=False):
        phases = [f"{getattr(r, f'actor_{p}_ms'):.3f}" for p in PHASES]
        lines.append("| " + " | ".join([
            r.agent, r.task, r.layout, r.actors, r.policy, r.regime, r.machine, f"q={r.bits}", str(r.comm_bits),
            str(r.runs), *phases,
            f"{r.actor_wall_ms:.3f} ({_or_dash(r.actor_cpu_ms, '.3f')})", _or_dash(r.service_cpu_ms, ".3f"),
            f"{r.learner_wall_ms:.1f} ({_or_dash(r.learner_cpu_ms, '.1f')})",
            r.bound_by]) + " |")
    return "\n".join(lines)


def _wire(bits: int, comm_bits: int) -> str:
    """A bar label's note of the wire's bit-width where it differs from the actors'."""
    return "" if comm_bits == bits else f", wire {comm_bits}"


def short_machine(machine: str) -> str:
    """A recorded machine ("<cpu name> (<vendor> family F model M)") as vendor and family/model, for a bar's label."""
    match = re.search(r"\((\w+) family (\d+) model (\d+)\)", machine)
    if not match:  # a name alone: its first words without trademarks and clock ("Intel Xeon", "AMD EPYC")
        return " ".join(re.sub(r"\(R\)|\(TM\)|Processor|CPU|@.*", " ", machine).split()[:3])
    vendor = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}.get(match.group(1), match.group(1))
    return f"{vendor} {match.group(2)}/{match.group(3)}"


def _short_bound(bound_by: str) -> str:
    """The bound in a word or two, for a bar's label."""
    head = bound_by.split(" (")[0]
    return "actors' core" if head.startswith("CPU on the actors") else head


def plot_time_split(table: pd.DataFrame) -> Figure:
    """Per agent and task: stacked actor ms per env step by phase, and the learner's ms per SGD step (CPU and rest),
    one bar per layout, regime and bit-width."""
    cases = list(dict.fromkeys(zip(table["agent"], table["task"])))
    if not cases:
        raise ValueError("no runs with actor episodes to plot")
    case_rows = [table[(table["agent"] == agent) & (table["task"] == task)] for agent, task in cases]
    # A case of many bars gets room below its axes for its upright labels.
    heights = [3.9 + (2.6 if len(rows) > 6 else 0.0) for rows in case_rows]
    fig = Figure(figsize=(12.0, sum(heights)), layout="constrained")
    axes = fig.subplots(len(cases), 2, squeeze=False, gridspec_kw={"height_ratios": heights})
    for (ax_actor, ax_learner), (agent, task), rows in zip(axes, cases, case_rows):
        labels = [f"{r.layout} {r.actors} {r.policy}\n{r.regime}, {short_machine(r.machine)}\nq={r.bits}"
                  f"{_wire(r.bits, r.comm_bits)}\n"
                  f"bound: {_short_bound(r.bound_by)}" for r in rows.itertuples(index=False)]
        x = np.arange(len(rows))
        bottom = np.zeros(len(rows))
        for phase in PHASES:
            ms = rows[f"actor_{phase}_ms"].fillna(0.0).to_numpy()
            ax_actor.bar(x, ms, bottom=bottom, color=PHASE_COLORS[phase],
                         label="replay write" if phase == "adder" else phase.replace("_", " "))
            bottom += ms
        if rows["actor_cpu_ms"].notna().any():
            ax_actor.plot(x, rows["actor_cpu_ms"], "k_", markersize=22, label="actor process CPU")
        wall = rows["learner_wall_ms"].to_numpy()
        cpu = rows["learner_cpu_ms"].to_numpy()
        known = ~np.isnan(cpu)
        if known.any():
            ax_learner.bar(x[known], cpu[known], color="#4c72b0", label="learner process CPU")
            ax_learner.bar(x[known], np.clip(wall[known] - cpu[known], 0.0, None), bottom=cpu[known],
                           color="#c8c8c8", label="waiting (sampling held, or no core)")
        if (~known).any():  # runs timed before the process clock: the step's wall time only
            ax_learner.bar(x[~known], wall[~known], color="#8c8c8c", hatch="//", label="SGD step (CPU not recorded)")
        for ax, unit in ((ax_actor, "ms per actor env step"), (ax_learner, "ms per learner SGD step")):
            # Many bars: each label on one upright line in its bar's width, instead of running into its neighbours.
            upright = len(rows) > 6
            ax.set_xticks(x, [label.replace("\n", ", ") for label in labels] if upright else labels,
                          fontsize="small" if len(rows) <= 4 else "x-small", rotation=90 if upright else 0)
            ax.set_ylabel(unit)
            ax.grid(axis="y", alpha=0.3)
        ax_actor.set_title(f"{agent} {task}: actors")
        ax_learner.set_title(f"{agent} {task}: learner")
        ax_actor.legend(fontsize="x-small", ncols=2)
        ax_learner.legend(fontsize="x-small")
    return fig
