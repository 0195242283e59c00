"""What Ray costs: env steps per second of the same short D4PG run under --launcher local and --launcher ray.

    python benchmarks/launchers.py --json results/launchers.json      # 3 interleaved pairs of 10k-env-step runs
    python benchmarks/launchers.py --quick --json /tmp/launchers.json  # 1 pair of 2.5k-env-step runs (a smoke test)

Runs alternate local, ray, local, ray, ... so the machine's drift hits both. `--launcher ray`
runs as a user's first try would: no --ray_address, so each run starts (and stops) its own Ray
instance on this machine, on loopback. Per run: the steady env-step rate (learner.csv, between
its first and last rows: start-up excluded), and the whole run's rate (summary.json's env steps
over the command's own seconds, from its start to its exit: Ray's start and stop included).
The headline `ray_over_local_env_steps_ratio` is the median steady rate under Ray over the
median local one (1 = Ray costs nothing); `ray_over_local_whole_run_ratio` counts the start-up too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actorq_jax.launch.placement import worker_env  # noqa: E402  (after the path insert)
from actorq_jax.run_dir import RunDir  # noqa: E402
from actorq_jax.telemetry import read_csv, write_json  # noqa: E402
from actorq_jax.telemetry.machine import machine_info  # noqa: E402

LAUNCHERS = ("local", "ray")
RUN_FLAGS = ["--task", "cartpole_balance", "--num_actors", "2", "--actor_bits", "8", "--policy_layers", "64,64",
             "--critic_layers", "64,64", "--batch_size", "64", "--min_replay_size", "200", "--eval_period", "500"]


def steady_rate(run_dir: Path) -> float:
    """Env steps per second between learner.csv's first and last rows (NaN with fewer than two rows)."""
    rows = read_csv(RunDir(run_dir).learner_csv) if RunDir(run_dir).learner_csv.exists() else []
    if len(rows) < 2 or rows[-1]["wall_seconds"] <= rows[0]["wall_seconds"]:
        return math.nan
    return (rows[-1]["env_steps"] - rows[0]["env_steps"]) / (rows[-1]["wall_seconds"] - rows[0]["wall_seconds"])


def _run(launcher: str, trial: int, env_steps: int, max_seconds: float, out: Path) -> Dict[str, Any]:
    run_dir = out / f"{launcher}_{trial}"
    cmd = [sys.executable, str(ROOT / "experiments" / "run_d4pg.py"), *RUN_FLAGS, "--launcher", launcher,
           "--max_env_steps", str(env_steps), "--max_seconds", str(max_seconds), "--seed", str(trial),
           "--results_dir", str(run_dir)]
    env = worker_env()
    started = time.monotonic()
    with open(out / f"{run_dir.name}.log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=max_seconds + 300).returncode
    process_seconds = time.monotonic() - started
    if code != 0 or not RunDir(run_dir).summary.exists():
        raise SystemExit(f"launchers: run {run_dir.name} failed (exit code {code}); see {out / (run_dir.name + '.log')}")
    summary = json.loads(RunDir(run_dir).summary.read_text())
    return {"launcher": launcher, "trial": trial, "run_dir": str(run_dir), "env_steps": summary["env_steps"],
            "wall_seconds": summary["wall_seconds"], "process_seconds": process_seconds,
            "steady_env_steps_per_s": steady_rate(run_dir),
            # From the command's start to its exit: Python, Ray's start and stop, the workers' start-up.
            "whole_run_env_steps_per_s": summary["env_steps"] / process_seconds, "loadavg_1": os.getloadavg()[0]}


def _median(rows: List[Dict[str, Any]], launcher: str, key: str) -> float:
    values = [r[key] for r in rows if r["launcher"] == launcher and r[key] == r[key]]
    return statistics.median(values) if values else math.nan


def headline(rows: List[Dict[str, Any]]) -> Dict[str, float]:
    """Ray over local: medians of the steady and whole-run env-step rates."""
    def ratio(key: str) -> float:
        local, ray = _median(rows, "local", key), _median(rows, "ray", key)
        return ray / local if local and local == local and ray == ray else math.nan

    return {"ray_over_local_env_steps_ratio": ratio("steady_env_steps_per_s"),
            "ray_over_local_whole_run_ratio": ratio("whole_run_env_steps_per_s")}


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the interleaved pairs, prints the table and the headline; writes --json when asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one pair of short runs (a smoke test)")
    parser.add_argument("--trials", type=int, default=3, help="pairs of runs (local then ray)")
    parser.add_argument("--env_steps", type=int, default=None, help="budget per run (default 10000; 2500 with --quick)")
    parser.add_argument("--max_seconds", type=float, default=600.0, help="wall-clock cap per run")
    parser.add_argument("--results_dir", default=None, help="where the runs go (default: results/launchers_<time>)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials must be >= 1, got {args.trials}")
    if not args.max_seconds > 0:
        parser.error(f"--max_seconds must be > 0, got {args.max_seconds}")
    if args.env_steps is not None and args.env_steps < 1:
        parser.error(f"--env_steps must be >= 1, got {args.env_steps}")
    trials = 1 if args.quick else args.trials
    env_steps = args.env_steps or (2500 if args.quick else 10000)
    out = Path(args.results_dir or f"results/launchers_{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    out.mkdir(parents=True, exist_ok=True)
    before = machine_info()
    rows = []
    for trial in range(trials):
        for launcher in LAUNCHERS:  # interleaved: local, ray, local, ray, ...
            rows.append(_run(launcher, trial, env_steps, args.max_seconds, out))
            print(f"[launchers] {launcher} trial {trial}: done", flush=True)
    print(f"{'launcher':>8} {'trial':>5} {'steady env/s':>12} {'whole-run env/s':>15} {'process s':>9} {'load1':>6}")
    for r in rows:
        print(f"{r['launcher']:>8} {r['trial']:>5} {r['steady_env_steps_per_s']:>12.0f} "
              f"{r['whole_run_env_steps_per_s']:>15.0f} {r['process_seconds']:>9.1f} {r['loadavg_1']:>6.2f}")
    head = headline(rows)
    print("headline: " + ", ".join(f"{k}={v:.3g}" for k, v in head.items()))
    if args.json:
        write_json(args.json, {"benchmark": "launchers",
                               "machine": {**machine_info(), "loadavg_before": before["loadavg_1_5_15"]},
                               "config": {"trials": trials, "env_steps": env_steps, "max_seconds": args.max_seconds,
                                          "quick": args.quick,
                                          "run_flags": RUN_FLAGS},
                               "rows": rows, "headline": head})
    return 0


if __name__ == "__main__":
    sys.exit(main())
