"""Env steps per second of one real actor process, fp32 policy against the int8 kernel backend.

The actor is the one every run uses (`python -m actorq_jax.launch.actor`): walker_walk,
a D4PG 2048x3 policy, n-step adder into Reverb, variables refreshed every 100 env
steps in the background while this process publishes a new version every
--publish_every seconds (as a learner would; the default 0.05 s outpaces both
actors, so every refresh pulls, deserializes and loads a new version). Each trial starts one actor process
per backend, in alternating order, held to one thread; the actor runs --episodes
episodes of 1000 steps and the first is dropped (jit compilation, first pull).
steps/s = episode steps / episode wall time, median over the kept episodes of all
trials; the headline is the median of the per-trial int8/fp32 ratios. A third
actor runs 4-bit weights (int4: the int8 backend's W4A8 packing) for comparison.

    python benchmarks/actor_throughput.py [--quick] [--json PATH]
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from actorq_jax.telemetry.schema import ACTOR_PHASES

ROOT = Path(__file__).resolve().parents[1]
TASK = "walker_walk"
LAYERS = (2048, 2048, 2048)
PHASES = ACTOR_PHASES


def _serve(backend: str, bits: int, publish_every: float, stop: threading.Event, results_dir: str):
    """Starts a Reverb server with replay, variables and config tables; publishes until `stop`."""
    import jax

    from actorq_jax.agents.d4pg.builder import D4PGBuilder
    from actorq_jax.agents.d4pg.config import D4PGConfig
    from actorq_jax.environments import environment_spec, make_environment
    from actorq_jax.launch import runtime
    from actorq_jax.launch.config import RunConfig
    from actorq_jax.quantization import QuantConfig
    from actorq_jax.replay import ReplayServer, ReplayTableConfig, VariablePublisher

    agent = D4PGConfig(policy_layers=LAYERS)
    run = RunConfig(agent="d4pg", task=TASK, results_dir=results_dir, actor_bits=bits, actor_backend=backend,
                    update_period=100, num_actors=1)
    spec = environment_spec(make_environment(TASK, seed=0))
    builder = D4PGBuilder(agent, spec)
    # No learner samples here, so the replay table must not rate-limit the actor.
    replay = ReplayTableConfig(name="replay", max_size=100_000, min_size=1, samples_per_insert=None)
    server = ReplayServer(runtime.learner_tables(builder, replay))
    client = server.client()
    runtime.publish_config(client, json.dumps({"run": dataclasses.asdict(run), "agent": dataclasses.asdict(agent)}))
    publisher = VariablePublisher(client, runtime.VARIABLES_TABLE, QuantConfig(bits=bits))
    params = jax.device_get(builder.params_template())

    def publish_loop() -> None:
        version = 0
        while not stop.is_set():
            publisher.publish(params, version)
            version += 1
            stop.wait(publish_every)

    thread = threading.Thread(target=publish_loop, daemon=True)
    thread.start()
    return server, thread


def _trial(backend: str, bits: int, episodes: int, publish_every: float) -> tuple:
    """Runs one actor process; returns steps/s of each episode after the first."""
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        server, thread = _serve(backend, bits, publish_every, stop, tmp)
        try:
            env = {**os.environ, "MUJOCO_GL": "disable", "TF_CPP_MIN_LOG_LEVEL": "2"}
            proc = subprocess.run(
                [sys.executable, "-m", "actorq_jax.launch.actor", "--server", f"localhost:{server.port}",
                 "--actor_id", "0", "--log_dir", tmp, "--threads", "1", "--max_episodes", str(episodes)],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"{backend} actor failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            import csv

            with open(Path(tmp) / "actor_0.csv", newline="") as f:
                rows = list(csv.DictReader(f))
        finally:
            stop.set()
            thread.join()
            server.stop()
    walls = [0.0] + [float(r["wall_seconds"]) for r in rows]
    rates = [int(r["episode_length"]) / (walls[i + 1] - walls[i]) for i, r in enumerate(rows)]
    # Milliseconds per env step in each phase (refresh phases run in the background thread).
    phases = {p: statistics.median(1e3 * float(r[f"{p}_s"]) / int(r["episode_length"]) for r in rows[1:])
              for p in PHASES}
    return rates[1:], phases


def main(argv=None) -> int:
    """Measures and prints the table; writes --json when asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one trial of 2 episodes per backend")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=3, help="episodes per actor (the first is dropped)")
    parser.add_argument("--publish_every", type=float, default=0.05, help="seconds between published versions")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    trials, episodes = (1, 2) if args.quick else (args.trials, args.episodes)
    cases = (("fp32", "fp32", 32), ("int8", "int8", 8), ("int4", "int8", 4))  # (name, backend, bits)
    rates = {name: [] for name, _, _ in cases}
    phases = {name: [] for name, _, _ in cases}
    ratios = {name: [] for name in ("int8", "int4")}
    for trial in range(trials):
        order = cases if trial % 2 == 0 else cases[::-1]
        per_trial = {}
        for name, backend, bits in order:
            per_trial[name], trial_phases = _trial(backend, bits, episodes, args.publish_every)
            rates[name] += per_trial[name]
            phases[name].append(trial_phases)
        for name in ratios:
            ratios[name].append(statistics.median(per_trial[name]) / statistics.median(per_trial["fp32"]))
    rows = [{"backend": name, "bits": bits, "median_steps_per_s": statistics.median(rates[name]),
             "episodes_measured": len(rates[name]),
             "speedup_vs_fp32": statistics.median(ratios[name]) if name in ratios else 1.0,
             **{f"{p}_ms_per_step": statistics.median(t[p] for t in phases[name]) for p in PHASES}}
            for name, _, bits in cases]
    headline = {"steps_per_s_speedup_int8": statistics.median(ratios["int8"])}
    print(f"actor_throughput: one actor process, {TASK}, policy {'x'.join(map(str, LAYERS))}, "
          f"refresh every 100 steps, {trials} trial(s)")
    print(f"{'backend':>8} {'bits':>5} {'steps/s':>10} {'episodes':>9}  ms/step: " + " ".join(f"{p:>11}" for p in PHASES))
    for row in rows:
        print(f"{row['backend']:>8} {row['bits']:>5} {row['median_steps_per_s']:>10.1f} {row['episodes_measured']:>9}  "
              + "         " + " ".join(f"{row[p + '_ms_per_step']:>11.3f}" for p in PHASES))
    print(f"headline: steps_per_s_speedup_int8={headline['steps_per_s_speedup_int8']:.2f} "
          f"(per-trial ratios {[round(r, 2) for r in ratios['int8']]}); "
          f"int4/fp32 {statistics.median(ratios['int4']):.2f} (per trial {[round(r, 2) for r in ratios['int4']]})")
    if args.json:
        from actorq_jax.telemetry.machine import machine_info

        Path(args.json).write_text(json.dumps({"benchmark": "actor_throughput", "machine": machine_info(), "rows": rows,
                                               "headline": headline}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
