"""Figures and the results table of a sweep (or of any folder of runs).

    python experiments/plot.py results/sweep_cartpole [--target_fraction 0.9] [--out DIR]

Writes into DIR (default SWEEP_DIR/plots): return_vs_wall_time.png,
return_vs_env_steps.png (mean and range over seeds per actor bit-width; the
actors' quantized policy dashed), actor_time_breakdown.png (actor time per env
step by phase), results.md and results.csv (per task and bit-width: time to the
target return, speedup and energy ratio against q=32, final return), and prints
the table. Needs no JAX.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; must precede anything that could pick an interactive backend

from actorq_jax import analysis  # noqa: E402


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Parses and checks the flags; exits 2 naming the flag on bad input."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    parser.add_argument("sweep_dir", metavar="SWEEP_DIR", help="a sweep directory (or one run's results directory)")
    parser.add_argument("--target_fraction", type=float, default=0.9,
                        help="target return = this fraction of the best fp32 evaluation return in the sweep")
    parser.add_argument("--target", type=float, default=None, help="an explicit target return (overrides the fraction)")
    parser.add_argument("--out", default=None, help="output folder (default: SWEEP_DIR/plots)")
    args = parser.parse_args(argv)
    if not 0.0 < args.target_fraction <= 1.0:
        parser.error(f"--target_fraction: must be in (0, 1], got {args.target_fraction}")
    if not Path(args.sweep_dir).is_dir():
        parser.error(f"SWEEP_DIR: {args.sweep_dir} is not a directory")
    if not analysis.find_run_dirs(args.sweep_dir):
        parser.error(f"SWEEP_DIR: no runs (folders with a config.json) under {args.sweep_dir}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Loads the sweep, writes figures and tables, prints the table."""
    args = parse(argv)
    sweep = analysis.load_sweep(args.sweep_dir)
    out = Path(args.out) if args.out else Path(args.sweep_dir) / "plots"
    incomplete = sweep.runs.loc[~sweep.runs["complete"], "run"].tolist()
    if incomplete:
        print(f"note: {len(incomplete)} run(s) without summary.json (still running or killed): {', '.join(incomplete)}")
    try:
        written = analysis.write_report(sweep, out, args.target_fraction, args.target)
    except ValueError as error:
        print(f"plot: {error}", file=sys.stderr)
        return 1
    table = analysis.results_table(sweep.runs, sweep.evals, args.target_fraction, args.target)
    print(analysis.describe_target(args.target_fraction, args.target))
    for task, rows in table.groupby("task", sort=True):
        print(f"\n{task}\n")
        print(analysis.to_markdown(analysis.display_table(rows.reset_index(drop=True)).drop(columns="task")))
    print()
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
