"""End to end, the paper's question: do q=8 actors reach the same return sooner, and with less energy, than q=32?

    python benchmarks/end_to_end.py --json results/end_to_end.json           # full: 3 seeds, two layouts
    python benchmarks/end_to_end.py --quick --json /tmp/e2e.json             # CI smoke: 1 short seed
    python benchmarks/end_to_end.py --agent dqn                              # DQN on CartPole-v1
    python benchmarks/end_to_end.py --task walker_stand --layouts pinned     # another task of the agent's suite
    python benchmarks/end_to_end.py -- --policy_layers 1024,1024,1024        # run flags for every run (after --)

A run already finished in --results_dir with the same flags is measured, not run again: rerun
the same command with a larger --seeds to add seeds, or after an interruption to continue.

Each run is a real launcher run (learner + Reverb, 2 actors, evaluator) in the paper's
replay regime (`--rate_limiter min_size --max_times_sampled N`: actors run free; `--rate_limiter ratio`
holds them to `--samples_per_insert` instead). Runs
alternate q=32, q=8, q=32, q=8, ... within each seed so the machine's drift hits both,
in two layouts (the runs' `--layout`): `shared` (every process on every core) and `pinned`
(the learner alone on core 0; the replay service, actors and evaluator on the rest: the
learner's speed cannot depend on the actors' precision, as the paper's learner had a GPU).
Time to target is `actorq_jax.analysis.aggregate.time_to_target`: the
wall time of the first evaluation whose mean fp32 return is at or above `--target_fraction`
of the task's best return (final evaluation included); a run that misses it is "not
reached" (`-`), never counted as its budget. Energy to target prorates the run's codecarbon
energy to that time. The headline's time and energy ratios compare means over the runs
that reached the target (q32 / q8), beside how many did; rates compare means over seeds
(q8 / q32); the pinned layout's keys are plain, the shared layout's end in _shared.
Where q=32 runs missed and every q=8 run reached, `time_to_target_speedup_q8_at_least`
bounds the speedup from below: each miss counts as the time of its last evaluation. With
`-- --stop_at_return 900` a run ends at its first evaluation at the target, so a grid
costs the time to target of its runs rather than its full budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actorq_jax.agents.registry import get_agent  # noqa: E402  (after the path insert)
from actorq_jax.analysis.loading import SWEEP_INDEX  # noqa: E402
from actorq_jax.analysis.run_figures import BITS, headline, measure_run  # noqa: E402  (headline: also the tests')
from actorq_jax.launch.placement import worker_env  # noqa: E402
from actorq_jax.run_dir import RunDir  # noqa: E402
from actorq_jax.telemetry import write_json  # noqa: E402
from actorq_jax.telemetry.machine import machine_info  # noqa: E402

# Per agent: task, the return that counts as solved, and layer flags (--quick runs the agent's registered quick
# preset instead). D4PG's policy size: a learner here makes about 63 / 21.5 / 6.7 SGD steps/s at 256x3 / 1024x3 /
# 2048x3 (benchmarks/learner.py measures it), and cartpole_balance needs roughly 5-10k SGD steps to reach 900 at
# 256x3, so 256x3 is the largest size whose 3-seed, 2-layout, 2-precision grid (12 runs) fits in about 75 minutes of runs.
AGENTS = {
    "d4pg": {"task": "cartpole_balance", "target": 1000.0, "layers": ["--policy_layers", "256,256,256",
                                                                       "--critic_layers", "256,256"]},
    "dqn": {"task": "CartPole-v1", "target": 500.0, "layers": ["--q_layers", "256,256"]},
}
LAYOUTS = ("pinned", "shared")


def _layout_flags(layout: str) -> List[str]:
    if layout == "pinned" and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("end_to_end: the pinned layout needs at least 2 cores")
    return ["--layout", layout]


def _command(agent: str, layout: str, bits: int, seed: int, args: argparse.Namespace, run_dir: Path) -> List[str]:
    spec = AGENTS[agent]
    return [sys.executable, str(ROOT / "experiments" / "run.py"), "--agent", agent, "--task", args.task,
           "--actor_bits", str(bits), "--seed", str(seed), "--num_actors", "2",
           *_regime_flags(args), "--max_seconds", str(args.max_seconds),
           "--eval_period", str(args.eval_period), "--results_dir", str(run_dir),
           *(get_agent(agent).quick if args.quick else spec["layers"]), *_layout_flags(layout),
           *args.run_flags]  # the same for both precisions: a setting, never a per-precision tuning


def _run(agent: str, layout: str, bits: int, seed: int, args: argparse.Namespace, out: Path) -> Path:
    run_dir = out / f"{agent}_{layout}_q{bits}_s{seed}"
    cmd = _command(agent, layout, bits, seed, args, run_dir)
    if _finished_with(run_dir, agent, cmd[4:]):
        print(f"[end_to_end] {run_dir.name}: kept (finished earlier in {out} with the same flags)", flush=True)
        return run_dir
    env = worker_env()
    with open(out / f"{run_dir.name}.log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.max_seconds + 600).returncode
    if code != 0 or not RunDir(run_dir).summary.exists():
        raise SystemExit(f"end_to_end: run {run_dir.name} failed (exit code {code}); see {out / (run_dir.name + '.log')}")
    return run_dir


def write_index(out: Path, argv: Optional[Sequence[str]], started: str, rows: List[Dict[str, Any]],
                finished: Optional[str], threshold: float) -> None:
    """The results directory's index (the sweep's format): the command, when it ran, its runs so far; what
    `experiments/report.py --collect` records beside the runs."""
    command = shlex.join([sys.executable, *sys.argv] if argv is None else ["benchmarks/end_to_end.py", *argv])
    runs = [{"name": Path(r["run_dir"]).name, "dir": Path(r["run_dir"]).name, "bits": r["bits"], "seed": r["seed"],
             "layout": r["layout"], "status": "done"} for r in rows]
    write_json(out / SWEEP_INDEX, {"command": command, "benchmark": "end_to_end", "threshold": threshold,
                                   "started": started, "finished": finished, "runs": runs})


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _parse_as_new(agent: str, flags: List[str], run_dir: Path) -> Any:
    """The run's (RunConfig, agent config) as a new run of `flags` would get them; a bad flag exits 2 naming it."""
    from actorq_jax.launch.flags import parse_run

    # With run_dir's name changed: the flags name run_dir, which parse_run refuses once it holds a run.
    flags = list(flags)
    flags[flags.index("--results_dir") + 1] = str(run_dir.with_name(run_dir.name + ".unused"))
    return parse_run(agent, flags)


def _finished_with(run_dir: Path, agent: str, flags: List[str]) -> bool:
    """Whether run_dir holds a finished run of exactly these flags (so a grid extended by seeds, or
    restarted after an interruption, reruns nothing it already has)."""
    from actorq_jax.launch.config import config_from_json

    try:
        summary = json.loads(RunDir(run_dir).summary.read_text())
        kept_run, kept_agent = config_from_json(RunDir(run_dir).config.read_text())
    except (OSError, ValueError):
        return False
    run, agent_config = _parse_as_new(agent, flags, run_dir)
    same = dataclasses.replace(kept_run, port=0, results_dir="-") == dataclasses.replace(run, port=0, results_dir="-")
    return summary.get("exit_code") == 0 and same and kept_agent == agent_config


def _regime_flags(args: argparse.Namespace) -> List[str]:
    if args.rate_limiter == "ratio":
        return ["--rate_limiter", "ratio", "--samples_per_insert", f"{args.samples_per_insert:g}"]
    return ["--rate_limiter", "min_size", "--max_times_sampled", str(args.max_times_sampled)]


def _print_table(rows: List[Dict[str, Any]], threshold: float) -> None:
    print(f"{'layout':>7} {'q':>3} {'seed':>4} {'to target s':>12} {'env steps':>10} {'Wh':>7} {'env/s':>7} "
          f"{'sgd/s':>6} {'final':>7}  bound by")
    for r in rows:
        reached = r["reached"]
        seconds = f"{r['time_to_target_s']:>12.0f}" if reached else f"{'-':>12}"
        steps = f"{r['env_steps_to_target']:>10,.0f}" if reached else f"{'-':>10}"
        energy = f"{1000 * r['energy_to_target_kwh']:>7.3f}" if reached else f"{'-':>7}"
        print(f"{r['layout']:>7} {r['bits']:>3} {r['seed']:>4} {seconds} {steps} {energy} {r['env_steps_per_s']:>7.0f} "
              f"{r['learner_steps_per_s']:>6.1f} {r['final_return']:>7.1f}  {r['bound_by']}")
    print(f"target: first evaluation with mean fp32 return >= {threshold:g} (final included); - = not reached")


def write_figures(rows: List[Dict[str, Any]], threshold: float, out: Path) -> List[Path]:
    """return_vs_wall_<layout>.png in `out`: fp32 evaluation return against wall time, mean and range over seeds per q."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import pandas as pd

    from actorq_jax import analysis

    written = []
    for layout in sorted({r["layout"] for r in rows}):
        runs = analysis.load_runs([r["run_dir"] for r in rows if r["layout"] == layout])
        points = analysis.eval_points(analysis.load_evals(runs))
        if points.empty:
            continue
        targets = pd.Series({task: threshold for task in points["task"].unique()})
        figure = analysis.plot_return_curves(points, "wall_seconds", targets=targets)
        figure.suptitle(f"end to end, {layout} layout: line = mean over seeds, band = range over seeds", fontsize="small")
        written.append(analysis.save_figure(figure, out / f"return_vs_wall_{layout}.png"))
    return written


def _int8_kernel() -> str:
    """What q=8 actors will run (the runs share this checkout): the int8 kernel's path, or a warning without it."""
    from actorq_jax import kernels

    if kernels.kernel_available():
        return kernels.describe_kernel()
    # Said before any run: without the kernel q=8 actors fall back to fake-quant at float speed, so every
    # speed ratio of the grid would compare two float actors.
    return (f"WARNING: {kernels.describe_kernel()}: q=8 actors will run fakequant at float speed; "
            f"build the kernel with `python -m actorq_jax.kernels.build`")


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the grid, prints the table and the headline, draws return against wall time; writes --json when asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", default="d4pg", choices=sorted(AGENTS))
    parser.add_argument("--task", default=None, help="the agent's task (default: cartpole_balance for d4pg, "
                        "CartPole-v1 for dqn); the target is --target_fraction of a return of 1000 (d4pg) or 500 (dqn)")
    parser.add_argument("--quick", action="store_true", help="1 seed of tiny networks and short budgets (a smoke test)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max_seconds", type=float, default=None, help="budget per run (default 300; 45 with --quick)")
    parser.add_argument("--eval_period", type=int, default=None, help="learner steps between evaluations")
    parser.add_argument("--rate_limiter", default="min_size", choices=("min_size", "ratio"),
                        help="replay regime of every run: min_size (the paper's, actors free) or ratio")
    parser.add_argument("--max_times_sampled", type=int, default=8,
                        help="with min_size: samples per replay item before removal")
    parser.add_argument("--samples_per_insert", type=float, default=32.0,
                        help="with ratio: SGD samples per inserted item that Reverb's limiter holds the actors to")
    parser.add_argument("--target_fraction", type=float, default=0.9)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list from {LAYOUTS}")
    parser.add_argument("--results_dir", default=None, help="where the runs go (default: results/end_to_end_<time>)")
    parser.add_argument("--json", default=None)
    parser.add_argument("run_flags", nargs="*", metavar="-- RUN_FLAGS",
                        help="flags added to every run after the defaults (e.g. -- --policy_layers 1024,1024,1024)")
    args = parser.parse_args(argv)
    forbidden = sorted({f for f in args.run_flags if f in ("--actor_bits", "--seed", "--results_dir", "--task")})
    if forbidden:
        parser.error(f"RUN_FLAGS: {', '.join(forbidden)} are the benchmark's to set")
    layouts = [x.strip() for x in args.layouts.split(",")]
    if not layouts or any(x not in LAYOUTS for x in layouts):
        parser.error(f"--layouts: {args.layouts!r}; choose from {LAYOUTS}")
    if not 0 < args.target_fraction <= 1:
        parser.error(f"--target_fraction must be in (0, 1], got {args.target_fraction}")
    for flag in ("seeds", "max_times_sampled"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: must be >= 1, got {getattr(args, flag)}")
    if not args.samples_per_insert > 0:
        parser.error(f"--samples_per_insert must be > 0, got {args.samples_per_insert}")
    args.task = args.task or AGENTS[args.agent]["task"]
    seeds = 1 if args.quick else args.seeds
    args.max_seconds = args.max_seconds or (45.0 if args.quick else 300.0)
    args.eval_period = args.eval_period or (50 if args.quick else 500)
    threshold = args.target_fraction * AGENTS[args.agent]["target"]
    out = Path(args.results_dir or f"results/end_to_end_{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    out.mkdir(parents=True, exist_ok=True)
    first = out / "flag_check"
    _parse_as_new(args.agent, _command(args.agent, layouts[0], BITS[0], 0, args, first)[4:], first)  # before any run
    kernel = _int8_kernel()
    print(f"[end_to_end] {kernel}", flush=True)
    before = machine_info()
    rows: List[Dict[str, Any]] = []
    started = _now()
    for seed in range(seeds):
        for layout in layouts:
            for bits in BITS:  # q32, q8 alternate within each seed and layout
                run_dir = _run(args.agent, layout, bits, seed, args, out)
                rows.append({"layout": layout, "bits": bits, "seed": seed, "run_dir": str(run_dir),
                             **measure_run(run_dir, threshold, len(os.sched_getaffinity(0)))})
                write_index(out, argv, started, rows, None, threshold)
                print(f"[end_to_end] {run_dir.name}: done", flush=True)
    write_index(out, argv, started, rows, _now(), threshold)
    _print_table(rows, threshold)
    head: Dict[str, float] = {}
    for layout in layouts:
        head.update(headline(rows, layout))
    print("headline: " + ", ".join(f"{k}={v:.3g}" for k, v in head.items()))
    figures = write_figures(rows, threshold, out)
    for path in figures:
        print(f"figure: {path}")
    if args.json:
        payload = {"benchmark": "end_to_end", "machine": {**machine_info(), "loadavg_before": before["loadavg_1_5_15"]},
                   "config": {"agent": args.agent, "task": args.task, "threshold": threshold, "int8_kernel": kernel,
                              "seeds": seeds, "max_seconds": args.max_seconds, "quick": args.quick,
                              "regime": _regime_flags(args), "run_flags": args.run_flags},
                   "rows": rows, "headline": head, "figures": [str(p) for p in figures]}
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
