"""Benchmark: publish (quantize + to_wire) and receive (from_wire + dequantize)
of a policy parameter tree at 32, 16, 8 and 4 bits, with payload bytes.

The default network is the paper's 2048x3 D4PG policy: obs 24 -> 2048 -> 2048
-> 2048 -> 6 (about 8.4M weights), as a flax-style nested dict
{"params": {"Dense_i": {"kernel", "bias"}}} built from numpy normals (no
dependency on the networks module). The four bit-widths are measured
interleaved, trial by trial, and reported as medians after a warm-up.

    python benchmarks/quantize.py [--quick] [--json PATH] [--hidden 2048] [--layers 3]

Headline (see BENCHMARKS.md): wire_bytes_ratio_8bit and wire_bytes_ratio_4bit,
each = payload bytes at b bits / payload bytes at 32 bits (smaller = fewer bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from actorq_jax.quantization import QuantConfig, dequantize, from_wire, quantize, to_wire, wire_nbytes  # noqa: E402
from actorq_jax.telemetry.machine import machine_info  # noqa: E402

BITS = (32, 16, 8, 4)
OBS_DIM, ACT_DIM = 24, 6


def policy_params(hidden: int, layers: int, seed: int = 0) -> dict:
    """Float32 params of an MLP obs -> hidden x layers -> act, flax layout."""
    rng = np.random.default_rng(seed)
    sizes = [OBS_DIM] + [hidden] * layers + [ACT_DIM]
    tree = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        tree[f"Dense_{i}"] = {
            "kernel": (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32),
            "bias": (0.01 * rng.standard_normal(fan_out)).astype(np.float32),
        }
    return {"params": tree}


def publish(params, config, version):
    return to_wire(quantize(params, config), version=version)  # to_wire waits for the device


def receive(arrays, like):
    qparams, version = from_wire(arrays, like=like)
    return jax.block_until_ready(dequantize(qparams)), version


def _measure(params, configs, repeats: int, warmup: int):
    """Payloads per bit-width and the interleaved send / receive times of every trial."""
    # Warm-up (compiles every case) and a bit-exact sanity check of the round trip.
    payload = {}
    for b in BITS:
        for _ in range(warmup):
            payload[b] = publish(params, configs[b], version=b)
            _, version = receive(payload[b], params)
        assert version == b
    send = {b: [] for b in BITS}
    recv = {b: [] for b in BITS}
    for trial in range(repeats):  # interleaved: every bit-width once per trial
        for b in BITS:
            t0 = time.perf_counter()
            arrays = publish(params, configs[b], version=trial)
            t1 = time.perf_counter()
            receive(arrays, params)
            t2 = time.perf_counter()
            send[b].append(t1 - t0)
            recv[b].append(t2 - t1)
    return payload, send, recv


def _rows(payload, send, recv, repeats: int) -> list:
    """One table row per bit-width: bytes, ratio against 32 bits, median times."""
    bytes32 = wire_nbytes(payload[32])
    return [{
        "bits": b,
        "payload_bytes": wire_nbytes(payload[b]),
        "bytes_ratio_vs_32": wire_nbytes(payload[b]) / bytes32,
        "quantize_to_wire_ms": 1e3 * float(np.median(send[b])),
        "from_wire_dequantize_ms": 1e3 * float(np.median(recv[b])),
        "num_arrays": len(payload[b]),
        "repeats": repeats,
    } for b in BITS]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few repeats (well under a minute)")
    ap.add_argument("--json", type=str, default=None, help="write results here")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=None, help="timed trials per case")
    args = ap.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 40)
    warmup = 1 if args.quick else 3

    params = jax.device_put(policy_params(args.hidden, args.layers))  # as the learner holds them
    n_weights = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(params))
    configs = {b: QuantConfig(bits=b) for b in BITS}

    payload, send, recv = _measure(params, configs, repeats, warmup)
    rows = _rows(payload, send, recv, repeats)
    by_bits = {r["bits"]: r for r in rows}
    headline = {
        "wire_bytes_ratio_8bit": by_bits[8]["bytes_ratio_vs_32"],
        "wire_bytes_ratio_4bit": by_bits[4]["bytes_ratio_vs_32"],
    }

    net = f"{OBS_DIM}->" + "->".join([str(args.hidden)] * args.layers) + f"->{ACT_DIM}"
    print(f"quantize benchmark: policy {net} ({n_weights / 1e6:.2f}M params), "
          f"per_channel symmetric, bf16 at 16 bits; median of {repeats} interleaved trials")
    print(f"{'bits':>4} | {'payload bytes':>13} | {'ratio vs 32':>11} | "
          f"{'quantize+to_wire ms':>19} | {'from_wire+dequantize ms':>23}")
    print("-" * 83)
    for r in rows:
        print(f"{r['bits']:>4} | {r['payload_bytes']:>13,} | {r['bytes_ratio_vs_32']:>11.4f} | "
              f"{r['quantize_to_wire_ms']:>19.2f} | {r['from_wire_dequantize_ms']:>23.2f}")
    print("headline: " + ", ".join(f"{k}={v:.4f}" for k, v in headline.items()))

    if args.json:
        result = {
            "benchmark": "quantize",
            "machine": {**machine_info(), "backend": jax.default_backend()},
            "network": {"layers": net, "num_params": n_weights},
            "rows": rows,
            "headline": headline,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
