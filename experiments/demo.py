"""The README's main job: a short ActorQ comparison, D4PG on cartpole_balance with 32-bit then 8-bit actors.

    python experiments/demo.py [--seconds_per_run 600] [--results_dir results/demo_<time>]
    python experiments/demo.py --quick --seconds_per_run 60   # a smoke run: D4PG's registered quick preset

Two runs, q=32 then q=8, in a setting of the end-to-end benchmark's grid (RESULTS.md, RQ3): the paper's
topology and regime on a 2-core machine. The learner has core 0 to itself (`--layout pinned`, as the
paper's learner had its GPU), the replay service, one actor stepping two environments and the evaluator
share core 1 (one actor process per actor core: two processes time-sharing a core cost about twice the
CPU per env step), and the actor runs free (`--rate_limiter min_size`, each item sampled at most 8 times).
A learner as fast as the actor drains such a table down to `--min_replay_size` items, every batch then drawn
from that window of the newest transitions: 10,000 (ten cartpole episodes) rather than the default 1,000 (one
episode: with it the policy saturated and sat at a return of 135 in 5 of 11 such runs; RESULTS.md, RQ3).
A seed's return can sit below 900 for minutes after an early peak, and a busy host slows a run: each run
therefore stops at its first evaluation at 900 (`--stop_at_return`) and at the latest after 600 s.
Ctrl-C stops the run in progress as it stops a run alone (its final checkpoint and evaluation follow; a
second Ctrl-C stops it at once), and the demo starts no further run.
Each run shows its progress line; then experiments/plot.py draws the curves and the demo prints the time to 900 of each
precision, their env-step rates, what bound each run, and why one seed is a demonstration rather than
a measurement.
"""

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from actorq_jax.agents.registry import get_agent  # noqa: E402  (after the path insert)
from actorq_jax.analysis.run_figures import measure_run  # noqa: E402
from actorq_jax.launch.flags import results_dir_problem  # noqa: E402

AGENT = "d4pg"
TARGET = 900.0  # cartpole_balance returns reach about 1000; 900 is "balanced"
RUN_FLAGS = [
    "--task", "cartpole_balance", "--num_actors", "1", "--envs_per_actor", "2", "--layout", "pinned",
    "--rate_limiter", "min_size", "--max_times_sampled", "8", "--min_replay_size", "10000",
    "--eval_period", "500", "--eval_episodes", "1", "--stop_at_return", str(TARGET),
]
NETWORKS = ["--policy_layers", "256,256,256", "--critic_layers", "256,256"]


INTERRUPTED = 130  # the shell's exit code for a command ended by Ctrl-C


def run_to_end(cmd: list) -> int:
    """Runs `cmd` (a launcher) to its end; INTERRUPTED if Ctrl-C came meanwhile, else its exit code."""
    # Inherits the terminal: the launcher's progress line shows while the run goes. It is in the demo's process
    # group, so a Ctrl-C reaches it too and it stops as it does alone (final checkpoint and evaluation, or at
    # once on a second Ctrl-C). The demo waits for that instead of killing it, which would lose both.
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    interrupted = False
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:
            interrupted = True
    return INTERRUPTED if interrupted else code


def _time(figures: dict) -> str:
    return f"{figures['time_to_target_s']:.0f} s" if figures["reached"] else "not reached"


def _explain(q32: dict, q8: dict) -> str:
    both = q32["reached"] and q8["reached"]
    speedup = q32["time_to_target_s"] / q8["time_to_target_s"] if both else math.nan
    throughput = q8["env_steps_per_s"] / q32["env_steps_per_s"] if q32["env_steps_per_s"] else math.nan
    ratio = f"q=8 {speedup:.2f}x as fast" if both else "no ratio (a run did not reach it)"
    lines = [f"demo: time to {TARGET:g}: q=32 {_time(q32)}, q=8 {_time(q8)}: {ratio}",
             f"demo: env steps/s q=8 / q=32: {throughput:.2f}x; bound by: q=32 {q32['bound_by']}; q=8 {q8['bound_by']}"]
    if both and min(q32["time_to_target_s"], q8["time_to_target_s"], q32["env_steps_to_target"]) > 0:
        # The time ratio is exactly the product of these two: env steps per second up to the target, and env steps needed.
        rate = {b: f["env_steps_to_target"] / f["time_to_target_s"] for b, f in ((32, q32), (8, q8))}
        lines.append(f"demo: up to {TARGET:g}, q=8 stepped {rate[8] / rate[32]:.2f}x as fast and needed "
                     f"{q8['env_steps_to_target'] / q32['env_steps_to_target']:.2f}x the env steps of q=32 "
                     f"({q8['env_steps_to_target']:,.0f} vs {q32['env_steps_to_target']:,.0f})")
    lines.append("demo: one seed per precision is a demonstration, not a measurement: the env steps a seed needs to reach "
                 "900 vary between seeds more than between precisions (RESULTS.md, RQ3). For the measured answer run "
                 "python benchmarks/end_to_end.py --layouts pinned --max_seconds 600 -- --num_actors 1 --envs_per_actor 2 "
                 "--min_replay_size 10000 "
                 "(3 seeds, interleaved).")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Runs the q=32 vs q=8 comparison, plots it and prints the ratio with its caveats."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds_per_run", type=float, default=600.0,
                        help=f"wall-clock cap of each run (a run ends sooner at its first evaluation at {TARGET:g})")
    parser.add_argument("--results_dir", default=None, help="where the two runs go (default: results/demo_<time>)")
    parser.add_argument("--quick", action="store_true",
                        help="the agent's registered quick preset (small networks, short warm-up) for a smoke run")
    args = parser.parse_args(argv)
    if args.seconds_per_run <= 0:
        parser.error(f"--seconds_per_run must be > 0, got {args.seconds_per_run}")
    out = Path(args.results_dir or f"results/demo_{time.strftime('%Y%m%d-%H%M%S')}")
    # Both runs' folders are checked before the first starts: a demo never stops between its two runs on a flag.
    problem = results_dir_problem(out)
    if problem:
        parser.error(f"--results_dir: {problem}")
    run_dirs = {bits: out / f"{AGENT}_cartpole_balance_q{bits}_s0" for bits in (32, 8)}
    taken = [str(d) for d in run_dirs.values() if (d / "config.json").exists()]
    if taken:
        parser.error(f"--results_dir: {out} already holds a demo run ({', '.join(taken)}); pick another")
    figures = {}
    for bits, run_dir in run_dirs.items():
        cmd = [sys.executable, str(HERE / "run.py"), "--agent", AGENT, *RUN_FLAGS,
               *(get_agent(AGENT).quick if args.quick else NETWORKS),
               "--actor_bits", str(bits), "--seed", "0", "--max_seconds", str(args.seconds_per_run),
               "--results_dir", str(run_dir)]
        print(f"demo: q={bits}: " + " ".join(cmd[1:]), flush=True)
        code = run_to_end(cmd)
        if code == INTERRUPTED:
            print(f"demo: interrupted; the q={bits} run stopped and kept what it had in {run_dir}; "
                  "no further run started", file=sys.stderr)
            return code
        if code != 0:
            print(f"demo: the q={bits} run failed (exit code {code}); see {run_dir}/logs", file=sys.stderr)
            return code
        figures[bits] = measure_run(run_dir, TARGET)
    code = subprocess.call([sys.executable, str(HERE / "plot.py"), str(out)])
    print(f"\ndemo: results in {out}/ (one run directory per bit-width, each with summary.json)")
    print(f"demo: plots and table in {out}/plots/ (results.md, return_vs_wall_time.png, actor_time_breakdown.png)")
    print(_explain(figures[32], figures[8]))
    return code


if __name__ == "__main__":
    sys.exit(main())
