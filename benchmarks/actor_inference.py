"""Actor inference: float32 XLA forward vs the int8 kernels, per forward of an MLP policy.

Policies 24 -> H x3 -> 6 (tanh between layers) for H = 256, 2048, 4096 at batch
1, 8 and 64. Each thread setting runs in its own subprocess because XLA reads
its thread flags once, when jax initialises; within a subprocess the float32,
int8 W8A32, int8 W8A8 and 4-bit W4A8 forwards are timed in interleaved trials
and the median microseconds per forward are compared (ratio = fp32 time / int8
time; the headline uses W8A32, the most conservative int8 scheme).

    python benchmarks/actor_inference.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Tuple

from actorq_jax.telemetry import write_json
from actorq_jax.telemetry.machine import machine_info

HIDDEN = (256, 2048, 4096)
BATCHES = (1, 8, 64)
THREADS = (1, 2)
OBS_DIM, ACTION_DIM = 24, 6
VARIANTS = ("fp32", "w8a32", "w8a8", "w4a8")
WORKER_TIMEOUT_S = 900  # a full run's worker takes well under a minute; a hang must not stall the run


def xla_flags(threads: int) -> str:
    """XLA CPU flags that hold the float32 side to ``threads`` threads."""
    if threads == 1:
        flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    else:
        flags = f"--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={threads}"
    existing = os.environ.get("XLA_FLAGS", "")
    return f"{existing} {flags}".strip()


def time_calls(call: Callable[[], Any], min_seconds: float) -> float:
    """Mean seconds per call of call() (which must block until done) over at least min_seconds and 2 calls."""
    calls, start = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        elapsed = time.perf_counter() - start
        if calls >= 2 and elapsed >= min_seconds:
            return elapsed / calls


def interleaved_medians(calls: Dict[str, Callable[[], Any]], trials: int, min_seconds: float) -> Dict[str, float]:
    """Median microseconds per call of each named call, over trials run in a rotating interleaved order."""
    names = list(calls)
    for call in calls.values():  # compile and warm caches
        call()
        call()
    times = {name: [] for name in names}
    for trial in range(trials):
        # Rotate the order each trial so no variant always runs first.
        order = names[trial % len(names):] + names[: trial % len(names)]
        for name in order:
            times[name].append(time_calls(calls[name], min_seconds))
    return {name: statistics.median(times[name]) * 1e6 for name in names}


def _forward(apply: Callable, params: Any, obs: Any) -> None:
    apply(params, obs).block_until_ready()


def policy_variants(hidden: int) -> Tuple[Callable, Dict[str, Any]]:
    """The jitted apply of the 24 -> hidden x3 -> 6 tanh policy, and its params per variant (fp32 and packed)."""
    import jax
    import numpy as np

    from actorq_jax import kernels
    from actorq_jax.networks import PolicyNetwork
    from actorq_jax.quantization import QuantConfig, quantize

    net = PolicyNetwork(action_dim=ACTION_DIM, layer_sizes=(hidden,) * 3, activation="tanh")
    params = net.init(jax.random.PRNGKey(0), np.zeros((1, OBS_DIM), np.float32))
    qparams = quantize(params, QuantConfig(bits=8))
    variant_params = {
        "fp32": params,
        "w8a32": kernels.pack_params(qparams, mode="w8a32"),
        "w8a8": kernels.pack_params(qparams, mode="w8a8"),
        "w4a8": kernels.pack_params(quantize(params, QuantConfig(bits=4)), mode="w4a8"),
    }
    return jax.jit(net.apply), variant_params


def worker(threads: int, quick: bool) -> list:
    """Measures every case at one thread setting (jax must not be initialised before this runs)."""
    import jax
    import numpy as np

    from actorq_jax import kernels

    kernels.set_num_threads(threads)
    trials = 3 if quick else 7
    min_seconds = 0.005 if quick else 0.02
    rows = []
    for hidden in HIDDEN:
        apply, variant_params = policy_variants(hidden)
        rng = np.random.default_rng(hidden)
        for batch in BATCHES:
            obs = jax.numpy.asarray(rng.normal(size=(batch, OBS_DIM)).astype(np.float32))
            calls = {v: functools.partial(_forward, apply, variant_params[v], obs) for v in VARIANTS}
            med = interleaved_medians(calls, trials, min_seconds)
            rows.append({
                "hidden": hidden,
                "batch": batch,
                "threads": threads,
                "fp32_us": round(med["fp32"], 1),
                "w8a32_us": round(med["w8a32"], 1),
                "w8a8_us": round(med["w8a8"], 1),
                "w4a8_us": round(med["w4a8"], 1),
                "speedup_w8a32": round(med["fp32"] / med["w8a32"], 2),
                "speedup_w8a8": round(med["fp32"] / med["w8a8"], 2),
                "speedup_w4a8": round(med["fp32"] / med["w4a8"], 2),
                "kernel": kernels.describe_kernel(),
            })
    return rows


def run_worker(script: str, threads: int, quick: bool) -> list:
    """Runs ``script --worker threads`` in a subprocess with XLA held to that many threads; its JSON rows."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(threads), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.abspath(script), "--worker", str(threads)]
    if quick:
        cmd.append("--quick")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"worker with {threads} thread(s) did not finish within {WORKER_TIMEOUT_S} s", file=sys.stderr)
        return []
    if proc.returncode != 0:
        print(f"worker with {threads} thread(s) failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return []
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_args(argv: list | None, description: str, quick_help: str) -> argparse.Namespace:
    """The options every inference benchmark takes: --quick, --json PATH, and the internal --worker THREADS."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def print_rows(rows: list) -> int:
    """A worker's output: its rows as one JSON line on stdout (what run_worker reads); exit status 0."""
    print(json.dumps(rows))
    return 0


def report(json_path: str | None, name: str, machine: dict, rows: list, headline: dict, meaning: str) -> int:
    """Prints the headline and writes the --json result (if asked); a benchmark's exit status, 0."""
    print(f"headline ({meaning}):", json.dumps(headline))
    if json_path:
        write_json(json_path, {"benchmark": name, "machine": machine, "rows": rows, "headline": headline})
    return 0


def main(argv: list | None = None) -> int:
    """Runs every thread setting in a subprocess, prints the table, writes --json."""
    args = parse_args(argv, __doc__.splitlines()[0], "fewer trials (under a minute)")
    if args.worker is not None:
        return print_rows(worker(args.worker, args.quick))

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = []
    for threads in THREADS:
        rows.extend(run_worker(__file__, threads, args.quick))
    machine = machine_info()
    kernel = rows[0]["kernel"] if rows else "unknown"
    print(f"actor_inference: MLP {OBS_DIM}->Hx3->{ACTION_DIM} (tanh), median us per forward; {kernel}")
    load_after = machine["loadavg_1_5_15"][0] if machine["loadavg_1_5_15"] else float("nan")
    print(f"load average (1 min) before / after: {load_before:.2f} / {load_after:.2f} on {machine['cores']} cores")
    header = ("| H | batch | threads | fp32 us | int8 w8a32 us | fp32/w8a32 | int8 w8a8 us | fp32/w8a8 "
              "| int4 w4a8 us | fp32/w4a8 |")
    print(header)
    print("|" + " --- |" * 10)
    for r in rows:
        print(
            f"| {r['hidden']} | {r['batch']} | {r['threads']} | {r['fp32_us']:.0f} | {r['w8a32_us']:.0f} "
            f"| {r['speedup_w8a32']:.2f}x | {r['w8a8_us']:.0f} | {r['speedup_w8a8']:.2f}x "
            f"| {r['w4a8_us']:.0f} | {r['speedup_w4a8']:.2f}x |"
        )

    def speedup(hidden: int, batch: int, threads: int):
        for r in rows:
            if (r["hidden"], r["batch"], r["threads"]) == (hidden, batch, threads):
                return r["speedup_w8a32"]
        return None

    headline = {
        "speedup_256x3_b1_t1": speedup(256, 1, 1),
        "speedup_2048x3_b1_t1": speedup(2048, 1, 1),
        "speedup_4096x3_b1_t1": speedup(4096, 1, 1),
        "speedup_2048x3_b1_t2": speedup(2048, 1, 2),
    }
    return report(args.json, "actor_inference", machine, rows, headline, "fp32 / int8 w8a32")


if __name__ == "__main__":
    sys.exit(main())
