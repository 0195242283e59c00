"""The README's main job: a short ActorQ comparison, D4PG on cartpole_balance with 32-bit then 8-bit actors.

    python experiments/demo.py [--seconds_per_run 240] [--results_dir results/demo_<time>]

Runs experiments/sweep.py over bits 32 and 8 (2 actors each), then experiments/plot.py,
and prints where the results, the summary table and the plots are.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Small networks and a short warm-up so learning shows within minutes on 2 CPU cores.
RUN_FLAGS = [
    "--task", "cartpole_balance", "--num_actors", "2",
    "--policy_layers", "256,256", "--critic_layers", "256,256",
    "--eval_period", "500", "--eval_episodes", "1",
]


def main(argv=None) -> int:
    """Runs the q=32 vs q=8 comparison and plots it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds_per_run", type=float, default=240.0, help="wall-clock budget of each run")
    parser.add_argument("--results_dir", default=None, help="sweep directory (default: results/demo_<time>)")
    args = parser.parse_args(argv)
    if args.seconds_per_run <= 0:
        parser.error(f"--seconds_per_run must be > 0, got {args.seconds_per_run}")
    sweep_dir = Path(args.results_dir or f"results/demo_{time.strftime('%Y%m%d-%H%M%S')}")
    sweep = [sys.executable, str(HERE / "sweep.py"), "--agent", "d4pg", "--bits", "32,8", "--seeds", "0",
             "--results_dir", str(sweep_dir), "--max_seconds", str(args.seconds_per_run), *RUN_FLAGS]
    print("demo: " + " ".join(sweep[1:]), flush=True)
    code = subprocess.call(sweep)
    if code != 0:
        print(f"demo: the sweep failed (exit code {code}); see {sweep_dir}", file=sys.stderr)
        return code
    code = subprocess.call([sys.executable, str(HERE / "plot.py"), str(sweep_dir)])
    print(f"\ndemo: results in {sweep_dir}/ (one run directory per bit-width, each with summary.json)")
    print(f"demo: plots and table in {sweep_dir}/plots/ (results.md, return_vs_wall_time.png, actor_time_breakdown.png)")
    return code


if __name__ == "__main__":
    sys.exit(main())
