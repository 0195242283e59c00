"""Env steps per second of one real actor process, fp32 policy against the int8 kernel backend, at K environments.

The actor is the one every run uses (`python -m actorq_jax.launch.actor`): walker_walk,
a D4PG 2048x3 policy, n-step adder into Reverb, variables refreshed every 100 env
steps in the background while this process publishes a new version every
--publish_every seconds (as a learner would; the default 0.05 s outpaces both
actors, so every refresh pulls, deserializes and loads a new version). The actor
steps K environments (--envs_per_actor, default K = 1, 8 and 32) in lockstep: one
policy call on a [K, obs] batch, K env steps and K adder writes per actor step.
Each trial starts one actor process per (K, backend), in alternating order, held to
one thread; the actor runs --episodes rounds of K episodes of 1000 steps (walker's
episodes all end at step 1000, so the K environments end together) and the first
round is dropped (jit compilation, first pull). --quick runs the same code path on
cartpole_balance (also 1000-step episodes) with a 256x3 policy: a smoke test.
steps/s = env steps of a round / its wall time, median over the kept rounds of all
trials; speedups are medians of the per-trial ratios. A third actor runs 4-bit
weights (int4: the int8 backend's W4A8 packing) for comparison. adder_us_per_transition
is the adder phase (the replay write, rate-limit waits excluded) per env step.

    python benchmarks/actor_throughput.py [--quick] [--envs_per_actor 1,8,32] [--json PATH]
"""

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from actorq_jax.kernels._library import ENV_PATH as ENV_KERNEL_PATH
from actorq_jax.launch.placement import worker_env
from actorq_jax.telemetry.schema import ACTOR_PHASES

ROOT = Path(__file__).resolve().parents[1]
TASK = "walker_walk"
LAYERS = (2048, 2048, 2048)
# --quick is a smoke test of the same code path: a cheap environment and policy, so its four actor
# processes spend their time on what the test checks (phases, rounds, headline), not on a 2048x3 fp32 forward.
QUICK_TASK = "cartpole_balance"
QUICK_LAYERS = (256, 256, 256)
PHASES = ACTOR_PHASES
# The measured actor joins as a remote actor of a one-actor run: ids below num_actors are the launcher's.
ACTOR_ID = 1


def _serve(backend: str, bits: int, envs: int, publish_every: float, stop: threading.Event, results_dir: str,
           task: str, layers: tuple):
    """Starts a replay service (its server and its loop) in this process; publishes variables until `stop`."""
    import jax

    from actorq_jax.agents.registry import get_agent
    from actorq_jax.environments import environment_spec, make_environment
    from actorq_jax.launch import runtime
    from actorq_jax.launch.config import RunConfig
    from actorq_jax.launch.replay_service import ReplayService
    from actorq_jax.quantization import QuantConfig
    from actorq_jax.replay import ReplayTableConfig, VariablePublisher

    entry = get_agent("d4pg")
    agent = entry.config_class(policy_layers=layers)
    run = RunConfig(agent="d4pg", task=task, results_dir=results_dir, actor_bits=bits, actor_backend=backend,
                    update_period=100, num_actors=1, envs_per_actor=envs)
    spec = environment_spec(make_environment(task, seed=0))
    builder = entry.make_builder(agent, spec)
    # No learner samples here, so the replay table must not rate-limit the actor.
    replay = ReplayTableConfig(name="replay", max_size=100_000, min_size=1, samples_per_insert=None)
    config_json = json.dumps({"run": dataclasses.asdict(run), "agent": dataclasses.asdict(agent)})
    service = ReplayService(builder, run, Path(results_dir), config_json, resume=False, replay=replay)
    service.serve_in_thread(stop)  # the actor's id lease and its rows' acknowledgements
    client = service.client
    publisher = VariablePublisher(client, runtime.VARIABLES_TABLE, QuantConfig(bits=bits))
    params = jax.device_get(builder.init_actor_params(jax.random.PRNGKey(0)))

    def publish_loop() -> None:
        version = 0
        while not stop.is_set():
            publisher.publish(params, version)
            version += 1
            stop.wait(publish_every)

    thread = threading.Thread(target=publish_loop, daemon=True)
    thread.start()
    return service, thread


def _backends(quick: bool, amx: bool) -> list:
    """The actors to compare, as (name, backend, bits, kernel path; "" for the default).

    fp32 and int8; int4 (int8's code path with another packing) except in --quick; and where the
    kernel multiplies on AMX tiles, the same int8 actor held to AVX-512 VNNI beside it (not in --quick,
    a smoke test of the code path).
    """
    backends = [("fp32", "fp32", 32, ""), ("int8", "int8", 8, "")]
    if not quick:
        backends += [("int8_vnni", "int8", 8, "avx512")] if amx else []
        backends.append(("int4", "int8", 4, ""))
    return backends


def _trial(backend: str, bits: int, envs: int, rounds: int, publish_every: float, task: str, layers: tuple,
           kernel_path: str = "") -> tuple:
    """Runs one actor process with `envs` environments; env steps/s of each round after the first, and the
    median milliseconds per env step of each phase. `kernel_path` forces the int8 kernel's path ("": its default)."""
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        service, thread = _serve(backend, bits, envs, publish_every, stop, tmp, task, layers)
        try:
            env = worker_env()
            if kernel_path:
                env[ENV_KERNEL_PATH] = kernel_path
            proc = subprocess.run(
                [sys.executable, "-m", "actorq_jax.launch.actor", "--server", f"127.0.0.1:{service.server.port}",
                 "--actor_id", str(ACTOR_ID), "--log_dir", tmp, "--threads", "1", "--max_episodes", str(rounds * envs)],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"{backend} actor failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            import csv

            with open(Path(tmp) / f"actor_{ACTOR_ID}.csv", newline="") as f:
                rows = list(csv.DictReader(f))
        finally:
            stop.set()
            thread.join()
            service.stop()
    return _rounds(rows)


def _rounds(rows: list) -> tuple:
    """(env steps/s of each round after the first, median ms per env step of each phase) from an actor's CSV rows.

    A round is the rows sharing an env_steps count (episodes that ended at the same actor step); a row's phase
    seconds are the actor's time since the previous row, so a round's are the sum of its rows'.
    """
    rounds = {}
    for r in rows:
        rounds.setdefault(int(r["env_steps"]), []).append(r)
    ends = sorted(rounds)
    rates, per_step = [], {p: [] for p in PHASES}
    for before, end in zip(ends, ends[1:]):
        steps = end - before
        wall = max(float(r["wall_seconds"]) for r in rounds[end]) - max(float(r["wall_seconds"]) for r in rounds[before])
        rates.append(steps / wall)
        # Milliseconds per env step in each phase (refresh phases run in the background thread).
        for p in PHASES:
            per_step[p].append(1e3 * sum(float(r[f"{p}_s"]) for r in rounds[end]) / steps)
    return rates, {p: statistics.median(v) for p, v in per_step.items()}


def _envs_list(text: str) -> tuple:
    """Parses --envs_per_actor: a comma list of K >= 1."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1, got {text!r}")
    return values


def _ratio(per_trial: list, num: tuple, den: tuple) -> float:
    """Median over trials of steps/s of case `num` over case `den` (cases are (K, backend))."""
    return statistics.median(statistics.median(t[num]) / statistics.median(t[den]) for t in per_trial)


def main(argv=None) -> int:
    """Measures and prints the table; writes --json when asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke test: one trial of 2 rounds per case, K = 1 and 8, fp32 and int8, {QUICK_TASK} "
                             f"with a {'x'.join(map(str, QUICK_LAYERS))} policy")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=3, help="rounds of K episodes per actor (the first is dropped)")
    parser.add_argument("--envs_per_actor", type=_envs_list, default=None,
                        help="comma list of environments per actor to measure (default 1,8,32; --quick: 1,8)")
    parser.add_argument("--publish_every", type=float, default=0.05, help="seconds between published versions")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    trials, rounds = (1, 2) if args.quick else (args.trials, args.episodes)
    if rounds < 2:
        parser.error(f"--episodes must be >= 2 (the first round is dropped), got {rounds}")
    task, layers = (QUICK_TASK, QUICK_LAYERS) if args.quick else (TASK, LAYERS)
    ks = args.envs_per_actor or ((1, 8) if args.quick else (1, 8, 32))
    from actorq_jax import kernels

    backends = _backends(args.quick, kernels.kernel_path() == "amx")
    cases = [(k, name, backend, bits, path) for k in ks for name, backend, bits, path in backends]
    rates = {(k, name): [] for k, name, *_ in cases}
    phases = {(k, name): [] for k, name, *_ in cases}
    per_trial = []
    for trial in range(trials):
        order = cases if trial % 2 == 0 else cases[::-1]
        this = {}
        for k, name, backend, bits, path in order:
            this[(k, name)], trial_phases = _trial(backend, bits, k, rounds, args.publish_every, task, layers, path)
            rates[(k, name)] += this[(k, name)]
            phases[(k, name)].append(trial_phases)
        per_trial.append(this)
    rows = [{"envs_per_actor": k, "backend": name, "bits": bits, "kernel_path": path or "default",
             "median_steps_per_s": statistics.median(rates[(k, name)]), "rounds_measured": len(rates[(k, name)]),
             "speedup_vs_fp32": _ratio(per_trial, (k, name), (k, "fp32")),
             **{f"{p}_ms_per_step": statistics.median(t[p] for t in phases[(k, name)]) for p in PHASES}}
            for k, name, _, bits, path in cases]
    headline = {}
    if 1 in ks:
        headline["steps_per_s_speedup_int8"] = _ratio(per_trial, (1, "int8"), (1, "fp32"))
    if 8 in ks:
        headline["steps_per_s_speedup_int8_k8"] = _ratio(per_trial, (8, "int8"), (8, "fp32"))
        headline["adder_us_per_transition_k8"] = 1e3 * statistics.median(
            r["adder_ms_per_step"] for r in rows if r["envs_per_actor"] == 8)
        if 1 in ks:
            headline["steps_per_s_k8_over_k1_int8"] = _ratio(per_trial, (8, "int8"), (1, "int8"))
    if 32 in ks:
        headline["steps_per_s_speedup_int8_k32"] = _ratio(per_trial, (32, "int8"), (32, "fp32"))
        if any(name == "int8_vnni" for _, name, *_ in cases):
            headline["steps_per_s_amx_over_vnni_k32"] = _ratio(per_trial, (32, "int8"), (32, "int8_vnni"))
            headline["steps_per_s_speedup_int8_vnni_k32"] = _ratio(per_trial, (32, "int8_vnni"), (32, "fp32"))
    print(f"actor_throughput: one actor process, {task}, policy {'x'.join(map(str, layers))}, "
          f"refresh every 100 env steps, {trials} trial(s), K = {', '.join(map(str, ks))}")
    print(kernels.describe_kernel())
    print(f"{'K':>3} {'backend':>9} {'bits':>5} {'steps/s':>10} {'vs fp32':>8} {'rounds':>7}  ms/env step: "
          + " ".join(f"{p:>11}" for p in PHASES))
    for row in rows:
        print(f"{row['envs_per_actor']:>3} {row['backend']:>9} {row['bits']:>5} {row['median_steps_per_s']:>10.1f} "
              f"{row['speedup_vs_fp32']:>8.2f} {row['rounds_measured']:>7}  " + "             "
              + " ".join(f"{row[p + '_ms_per_step']:>11.3f}" for p in PHASES))
    print("headline: " + ", ".join(f"{key}={value:.2f}" for key, value in headline.items()))
    if args.json:
        from actorq_jax.telemetry.machine import machine_info

        Path(args.json).write_text(json.dumps({"benchmark": "actor_throughput", "machine": machine_info(), "task": task,
                                               "policy_layers": list(layers), "rows": rows,
                                               "headline": headline}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
