"""Regenerates the tables of record in RESULTS.md, and their figures, from the committed records; runs nothing.

    python experiments/report.py                                   # every study under results/records
    python experiments/report.py --collect SWEEP_DIR [SWEEP_DIR ...] --study NAME   # record finished runs, then regenerate
    python experiments/report.py --check                           # exit 1 if RESULTS.md differs from the records

A study's table sits in RESULTS.md between `<!-- report:NAME -->` and
`<!-- /report:NAME -->`; everything between the two markers is rewritten.
`--collect` copies each finished run (one with summary.json) of the given sweep
or run directories into results/records/NAME/ (config.json, summary.json,
eval.csv, learner.csv, actors/*.csv; no checkpoints or logs; see
actorq_jax/analysis/records.py). Needs no JAX.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")  # files only; must precede anything that could pick an interactive backend

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actorq_jax import analysis  # noqa: E402  (after the path insert)

TOLERANCE = 0.05  # RQ2: "within 5% of q=32's final return"


def _date(stamp: Optional[str]) -> str:
    if not stamp:
        return "unknown date"
    return datetime.datetime.fromisoformat(stamp).strftime("%Y-%m-%d")


def _command(command: Optional[str]) -> str:
    """The recorded command with its interpreter's path shortened to `python`."""
    if not command:
        return "not recorded"
    head, _, rest = command.partition(" ")
    return f"python {rest}" if Path(head).name.startswith("python") else command


def _provenance(study_dir: Path, runs: int) -> List[str]:
    """Lines naming the records, the commands that made them, when, and the CPU they were collected on."""
    index = analysis.read_study(study_dir)
    shown = study_dir.resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
    lines = [f"Records: `{shown.as_posix()}` ({runs} finished runs)."]
    for name, source in sorted(index.get("sources", {}).items()):
        machine = source.get("collected_on", {})
        lines.append(f"- `{name}`: started {_date(source.get('started'))}, "
                     f"{len(source.get('runs_collected', []))} finished runs collected {_date(source.get('collected'))} "
                     f"on {machine.get('cpu', 'an unrecorded CPU')} ({machine.get('cores', '?')} cores); "
                     f"command `{_command(source.get('command'))}`")
    return lines


def render_rq2(study_dir: Path, figures_dir: Path, figure_link: str) -> str:
    """RQ2's table (returns per actor bit-width) and figure from a record set; returns the markdown block."""
    sweep = analysis.load_sweep(study_dir)
    table = analysis.bits_table(sweep.runs, sweep.evals)
    lines = _provenance(study_dir, int(sweep.runs["complete"].sum()))
    lines += ["", analysis.bits_markdown(table, TOLERANCE), ""]
    lines.append("Final: the shutdown evaluation's mean return over its episodes; best: the highest evaluation's "
                 "after the first SGD step; "
                 f"mean ± sample std over seeds. \"Within {TOLERANCE:.0%}\": mean final return >= q=32's less "
                 f"{TOLERANCE:.0%} of its size; a higher return counts as within, and the bit-widths above the "
                 f"fewest need not pass.")
    if not table.empty:
        analysis.save_figure(analysis.plot_return_vs_bits(table), figures_dir / "rq2_return_vs_bits.png")
        lines += ["", f"![final and best return against actor bits]({figure_link}rq2_return_vs_bits.png)"]
    return "\n".join(lines)


def render_rq4(study_dir: Path, figures_dir: Path, figure_link: str) -> str:
    """RQ4's table (where actor and learner time goes, per layout, regime and bits) and figure from a record set,
    together with the end-to-end grids recorded for RQ3 (study rq3 beside it), which add their layouts."""
    from actorq_jax.analysis.time_split import plot_time_split, time_split, time_split_markdown

    studies = [study_dir] + [d for d in (study_dir.parent / "rq3",) if d.is_dir()]
    runs = analysis.load_runs([run for d in studies for run in analysis.find_run_dirs(d)])
    recorded_on = {s.get("collected_on", {}).get("cores") for d in studies
                   for s in analysis.read_study(d).get("sources", {}).values()}
    cores = recorded_on.pop() if len(recorded_on) == 1 else None  # one machine: runs without their cores use its
    # Runs recorded before summaries named their machine: the machine their record set was collected on.
    collected_on = {run: _machine_name(source.get("collected_on", {})) for d in studies
                    for source in analysis.read_study(d).get("sources", {}).values()
                    for run in source.get("runs_collected", [])}
    runs["machine"] = [m if isinstance(m, str) and m else collected_on.get(r) for r, m in zip(runs["run"], runs["machine"])]
    table = time_split(runs, analysis.load_actor_episodes(runs), analysis.load_learner(runs), cores)
    lines: List[str] = []
    for d in studies:
        lines += ([""] if lines else []) + _provenance(d, int(analysis.load_runs(analysis.find_run_dirs(d))["complete"].sum()))
    lines += ["", time_split_markdown(table), ""]
    lines.append("Actor phases: ms of wall time per env step, mean over runs; in brackets the actor process's CPU "
                 "per env step. Replay service CPU: the service process's CPU per env step (measured by the "
                 "launcher since the end-to-end grids; \"-\": not measured). Learner: ms of wall time per SGD step "
                 "after its first log row, in brackets its process's CPU per step. \"-\": the run's timers took one "
                 "thread's CPU only (before the process clock), which misses XLA's compute threads. Bound by: the "
                 "summed actor phases (the rate limiter above 30% of actor time means the learner bounds the run), "
                 "and where every run of a row has each process's CPU, how full the actors' cores were and who "
                 "filled them.")
    if not table.empty:
        analysis.save_figure(plot_time_split(table), figures_dir / "rq4_time_split.png")
        lines += ["", f"![where actor and learner time goes]({figure_link}rq4_time_split.png)"]
    return "\n".join(lines)


def _machine_name(collected_on: Dict[str, Any]) -> Optional[str]:
    """A record set's machine as run summaries name theirs: "<cpu> (<cpu_id>)", or the CPU alone (None if unsaid)."""
    cpu, cpu_id = collected_on.get("cpu"), collected_on.get("cpu_id")
    return (f"{cpu} ({cpu_id})" if cpu_id else cpu) or None


def _e2e_row(run_dir: Path, threshold: float, cores: Optional[int]) -> Dict:
    """One end-to-end run's figures (analysis.measure_run) with its bits, seed, layout and per-step actor phases;
    `cores`: the recording machine's, for runs that did not record their workers' cores."""
    import json

    from actorq_jax.analysis.run_figures import measure_run

    config = json.loads((run_dir / "config.json").read_text())["run"]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = max(1, int(summary["env_steps"]))
    wall, cpu = summary.get("actor_time_s", {}), summary.get("actor_cpu_time_s", {})
    per_step = {p: (1000 * wall.get(p, 0.0) / steps, 1000 * cpu.get(p, 0.0) / steps) for p in wall}
    service = summary.get("worker_cpu_s", {}).get("replay")
    return {"bits": int(config["actor_bits"]), "seed": int(config["seed"]), "layout": config.get("layout", "shared"),
            "task": config.get("task"),
            "run_dir": str(run_dir), "phase_ms": per_step,
            "service_cpu_ms": 1000 * service / steps if service else None, **measure_run(run_dir, threshold, cores)}


def _e2e_markdown(rows: List[Dict], threshold: float) -> List[str]:
    def dash(value: float, pattern: str) -> str:
        return "-" if value != value else format(value, pattern)

    lines = [f"| q | seed | time to {threshold:g} (s) | env steps to {threshold:g} | Wh to {threshold:g} | env steps/s | "
             f"SGD steps/s | final return | actor ms per env step, wall / CPU: env step, inference, replay write | "
             f"limiter wait ms | bound by |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        phases = ", ".join(f"{r['phase_ms'].get(p, (0, 0))[0]:.2f} / {r['phase_ms'].get(p, (0, 0))[1]:.2f}"
                           for p in ("env_step", "inference", "adder"))
        lines.append(f"| {r['bits']} | {r['seed']} | {dash(r['time_to_target_s'], '.0f')} | "
                     f"{dash(r['env_steps_to_target'], ',.0f')} | {dash(1000 * r['energy_to_target_kwh'], '.3f')} | "
                     f"{r['env_steps_per_s']:.0f} | {r['learner_steps_per_s']:.1f} | {dash(r['final_return'], '.1f')} | "
                     f"{phases} | {r['phase_ms'].get('rate_limit_wait', (0, 0))[0]:.2f} | {r['bound_by']} |")
    return lines


def render_rq3(study_dir: Path, figures_dir: Path, figure_link: str) -> str:
    """RQ1/RQ3's end-to-end tables (q=8 against q=32 actors), one per recorded benchmarks/end_to_end.py grid."""

    import pandas as pd

    from actorq_jax.analysis.run_figures import BITS, headline

    sources = analysis.read_study(study_dir).get("sources", {})
    lines = _provenance(study_dir, sum(len(s.get("runs_collected", [])) for s in sources.values()))
    for name, source in sorted(sources.items()):
        threshold, rows = _grid_rows(study_dir, name, source)
        rows.sort(key=lambda r: (r["layout"], r["seed"], -r["bits"]))
        lines += ["", f"**`{name}`** (target {threshold:g}: the first evaluation whose mean fp32 return reaches it):", ""]
        lines += _e2e_markdown(rows, threshold)
        for layout in sorted({r["layout"] for r in rows}):
            head = headline(rows, layout)
            service = [r["service_cpu_ms"] for r in rows if r["layout"] == layout and r["service_cpu_ms"]]
            shown = ", ".join(f"`{k}` {'-' if v != v else format(v, '.3g')}" for k, v in head.items())
            lines += ["", f"Headline, {layout}: {shown}."]
            if service:
                lines.append(f"The replay service's CPU: {min(service):.2f}-{max(service):.2f} ms per env step.")
            runs = analysis.load_runs([r["run_dir"] for r in rows if r["layout"] == layout and r["bits"] in BITS])
            points = analysis.eval_points(analysis.load_evals(runs))
            if not points.empty:
                targets = pd.Series({task: threshold for task in points["task"].unique()})
                figure = analysis.plot_return_curves(points, "wall_seconds", targets=targets)
                figure.suptitle(f"{name}: line = mean over seeds, band = range over seeds", fontsize="small")
                analysis.save_figure(figure, figures_dir / f"rq3_{name}.png")
                lines += ["", f"![return against wall time, {name}]({figure_link}rq3_{name}.png)"]
    lines += ["", "Actor phases: ms per env step over the run (both actors), wall time / the actor process's CPU (the "
              "process clock counts every thread of the process during the phase). Bound by: the actors' timers "
              "(analysis.run_figures.bottleneck), and where the launcher measured each process's CPU, how full the "
              "actors' cores were and who filled them (the replay service and evaluator share them in the pinned "
              "layout). Time and energy ratios: means over the runs that reached the target; `-`: not reached, never "
              "counted as the budget."]
    return "\n".join(lines)


def _grid_rows(study_dir: Path, name: str, source: Dict) -> Tuple[float, List[Dict]]:
    """One recorded end-to-end grid: its target and its runs' rows (_e2e_row)."""
    import json

    index_path = study_dir / "sweeps" / f"{name}.json"
    threshold = float((json.loads(index_path.read_text()) if index_path.is_file() else {}).get("threshold", 900.0))
    cores = source.get("collected_on", {}).get("cores")
    return threshold, [_e2e_row(study_dir / run, threshold, cores) for run in source.get("runs_collected", [])]


def render_rq1(study_dir: Path, figures_dir: Path, figure_link: str) -> str:
    """RQ1's multi-task table: q=8 against q=32 actors per task (one recorded end-to-end grid per task) and its figure."""
    import pandas as pd

    from actorq_jax.analysis.run_figures import BITS, headline

    def mean(rows: List[Dict], key: str, pattern: str) -> str:
        values = [r[key] for r in rows if r[key] == r[key]]
        return format(sum(values) / len(values), pattern) if values else "-"

    sources = analysis.read_study(study_dir).get("sources", {})
    lines = _provenance(study_dir, sum(len(s.get("runs_collected", [])) for s in sources.values()))
    lines += ["", "| task | target | q | seeds | reached | time to target (s) | env steps to target | Wh to target | "
              "env steps/s | SGD steps/s | final return | time speedup q=8 | energy ratio q=32/q=8 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    points, targets = [], {}
    for name, source in sorted(sources.items()):
        threshold, rows = _grid_rows(study_dir, name, source)
        for task in sorted({r["task"] for r in rows}):
            task_rows = [r for r in rows if r["task"] == task]
            head = headline(task_rows, "pinned") if all(r["layout"] == "pinned" for r in task_rows) else {}
            for bits in BITS:
                group = [r for r in task_rows if r["bits"] == bits]
                if not group:
                    continue
                finals = [r["final_return"] for r in group]
                ratios = ["-", "-"] if bits == 32 else [
                    "-" if head.get(k, math.nan) != head.get(k, math.nan) else f"{head[k]:.2f}x"
                    for k in ("time_to_target_speedup_q8", "energy_to_target_ratio_q8")]
                lines.append(f"| {task} | {threshold:g} | {bits} | {len(group)} | {sum(r['reached'] for r in group)} | "
                             f"{mean(group, 'time_to_target_s', '.0f')} | {mean(group, 'env_steps_to_target', ',.0f')} | "
                             f"{mean([dict(r, wh=1000 * r['energy_to_target_kwh']) for r in group], 'wh', '.3f')} | "
                             f"{mean(group, 'env_steps_per_s', '.0f')} | {mean(group, 'learner_steps_per_s', '.1f')} | "
                             f"{' / '.join('-' if f != f else f'{f:.0f}' for f in finals)} | {ratios[0]} | {ratios[1]} |")
            targets[task] = threshold
        runs = analysis.load_runs([r["run_dir"] for r in rows if r["bits"] in BITS])
        points.append(analysis.eval_points(analysis.load_evals(runs)))
    lines += ["", "Means over the seeds that reached the target (`-`: none did; a miss never counts as the budget); "
              "final return: each seed's final evaluation (fp32 policy), in seed order. Time speedup: mean time to "
              "target at q=32 over q=8's; energy ratio likewise (codecarbon, prorated to the time of the target)."]
    frame = pd.concat(points, ignore_index=True) if points else pd.DataFrame()
    if not frame.empty:
        figure = analysis.plot_return_curves(frame, "wall_seconds", targets=pd.Series(targets))
        figure.suptitle("q=8 against q=32 actors per task: line = mean over seeds, band = range", fontsize="small")
        analysis.save_figure(figure, figures_dir / "rq1_multitask.png")
        lines += ["", f"![return against wall time per task]({figure_link}rq1_multitask.png)"]
    return "\n".join(lines)


# Study name -> its renderer. A study under results/records without one is listed, not rendered.
STUDIES: Dict[str, Callable[[Path, Path, str], str]] = {
    "rq1": render_rq1, "rq2": render_rq2, "rq3": render_rq3, "rq4": render_rq4}


def replace_block(text: str, study: str, block: str) -> str:
    """`text` with the lines between the study's report markers replaced by `block`."""
    begin, end = f"<!-- report:{study} -->", f"<!-- /report:{study} -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"RESULTS.md needs exactly one {begin} ... {end} pair")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{block}\n{end}{tail}"


def regenerate(records: Path, results_md: Path, figures_dir: Path, figure_link: str = "docs/figures/") -> str:
    """The new RESULTS.md text: each known study's block redrawn from `records`; figures written to `figures_dir`."""
    text = results_md.read_text()
    for study_dir in sorted(p for p in records.iterdir() if p.is_dir()) if records.is_dir() else []:
        render = STUDIES.get(study_dir.name)
        if render is None:
            print(f"report: {study_dir.name}: no table of record is defined for this study; skipped")
            continue
        block = render(study_dir, figures_dir, figure_link)
        print(f"## {study_dir.name}\n\n{block}\n")
        text = replace_block(text, study_dir.name, block)
    return text


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Parses and checks the flags; exits 2 naming the flag on bad input."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--records", default=str(ROOT / "results" / "records"), help="the record sets, one folder per study")
    parser.add_argument("--results_md", default=str(ROOT / "RESULTS.md"), help="the file whose report blocks are rewritten")
    parser.add_argument("--figures", default=str(ROOT / "docs" / "figures"), help="where figures are written")
    parser.add_argument("--collect", nargs="+", default=None, metavar="DIR",
                        help="sweep or run directories whose finished runs are recorded first (needs --study)")
    parser.add_argument("--study", default=None, help="the study --collect records into")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if RESULTS.md differs")
    args = parser.parse_args(argv)
    if args.collect is not None:
        if not args.study:
            parser.error("--collect needs --study NAME")
        if args.study not in STUDIES:
            # A misspelt study would otherwise record the runs into a folder no table is drawn from.
            parser.error(f"--study: {args.study!r} has no table of record; choose from {', '.join(STUDIES)}")
        missing = [d for d in args.collect if not Path(d).is_dir()]
        if missing:
            parser.error(f"--collect: not a directory: {', '.join(missing)}")
        empty = [d for d in args.collect if not analysis.finished_runs(d)]
        if empty:
            # Checked for every source first: a bad one records nothing of the others either.
            parser.error(f"--collect: no finished run (a run folder whose summary.json says it ran its budget) "
                         f"under {', '.join(empty)}")
    elif args.study:
        parser.error("--study is for --collect")
    if not Path(args.results_md).is_file():
        parser.error(f"--results_md: {args.results_md} does not exist")
    if args.collect is None and not Path(args.records).is_dir():
        # Nothing to draw from: RESULTS.md would be "rewritten" unchanged, which reads as a success.
        parser.error(f"--records: {args.records} is not a directory of record sets")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Collects when asked, then rewrites RESULTS.md's report blocks and the figures (or checks them)."""
    args = parse(argv)
    records, results_md = Path(args.records), Path(args.results_md)
    for source in args.collect or []:
        written = analysis.collect(source, records, args.study)
        print(f"report: {source}: {len(written)} finished runs recorded in {records / args.study}")
    try:
        if args.check:
            with tempfile.TemporaryDirectory() as scratch:  # figures are drawn, not kept
                text = regenerate(records, results_md, Path(scratch))
        else:
            text = regenerate(records, results_md, Path(args.figures))
    except ValueError as error:
        print(f"report: {error}", file=sys.stderr)
        return 1
    if args.check:
        same = text == results_md.read_text()
        print(f"report: {results_md} {'matches' if same else 'differs from'} the records")
        return 0 if same else 1
    results_md.write_text(text)
    print(f"report: wrote {results_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
