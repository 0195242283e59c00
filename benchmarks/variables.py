"""Variable server and replay throughput: what an actor's weight refresh costs at 32/16/8/4 bits.

Two processes, as in a run: this one hosts the Reverb server and the learner side
(VariablePublisher, ReplayDataset); a spawned actor process holds a VariableClient
and an NStepAdder. Policy: the 2048x3 MLP (24 -> 2048 -> 2048 -> 2048 -> 6) as a
flax-style nested dict of float32 numpy arrays (34 MB).

Each trial publishes the policy once at every bit width (the order rotates between
trials) and has the actor refresh it right after, so the widths are measured side by
side. Stage times are medians over trials after a warm-up trial:
  publish      quantize + to_wire + insert (learner process)
  pull         server_info + sample of the item (actor process, over gRPC)
  deserialize  from_wire, including its device_put
  load         the actor's load_fn: jax.block_until_ready of the decoded tree
refresh = pull + deserialize + load; refresh_speedup = fp32 refresh / b-bit refresh,
the median of the per-trial ratios. Then the actor's NStepAdder (n=5) writes
episodes into an unthrottled replay table for a while (transitions/s), and the
learner samples batches of 256 from it (batches/s).

    python benchmarks/variables.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

from actorq_jax.telemetry.machine import machine_info

OBS_DIM, ACTION_DIM, HIDDEN, LAYERS = 24, 6, 2048, 3
BITS = (32, 16, 8, 4)
N_STEP, GAMMA, BATCH = 5, 0.99, 256


def policy_params(seed: int) -> dict:
    """The 2048x3 policy as a flax-style {'params': {'Dense_i': {kernel, bias}}} tree."""
    rng = np.random.default_rng(seed)
    sizes = [OBS_DIM] + [HIDDEN] * LAYERS + [ACTION_DIM]
    layers = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers[f"Dense_{i}"] = {
            "kernel": (rng.standard_normal((fan_in, fan_out), dtype=np.float32) / np.sqrt(fan_in)),
            "bias": np.zeros(fan_out, np.float32),
        }
    return {"params": layers}


def _actor_process(address: str, conn, seed: int) -> None:
    """The actor: refreshes variables on request and runs the adder; replies with plain numbers."""
    import dm_env
    import jax

    from actorq_jax.replay import NStepAdder, VariableClient, wait_for_server

    like = policy_params(0)
    client = VariableClient(address, "variables", update_period=10**9, like=like,
                            load_fn=jax.block_until_ready)
    try:
        while True:
            command = conn.recv()
            if command[0] == "refresh":
                want = command[1]
                deadline = time.monotonic() + 60
                while client.version != want and time.monotonic() < deadline:
                    client.refresh(timeout_s=60)
                timing = client.timings[-1]
                conn.send((timing.version, timing.nbytes, timing.pull_s, timing.deserialize_s,
                           timing.load_s))
            elif command[0] == "adder":
                seconds = command[1]
                rng = np.random.default_rng(seed)
                observations = rng.standard_normal((1001, OBS_DIM), dtype=np.float32)
                actions = rng.standard_normal((1000, ACTION_DIM), dtype=np.float32)
                adder = NStepAdder(wait_for_server(address, 30), "replay", N_STEP, GAMMA)
                start, steps = time.perf_counter(), 0
                while time.perf_counter() - start < seconds:
                    adder.add_first(dm_env.restart(observations[0]))
                    for t in range(1000):
                        last = t == 999 or time.perf_counter() - start >= seconds
                        step_type = dm_env.StepType.LAST if last else dm_env.StepType.MID
                        adder.add(actions[t], dm_env.TimeStep(step_type, 1.0, 1.0, observations[t + 1]))
                        steps += 1
                        if last:
                            break
                adder.close()
                conn.send((steps, adder.items_written, time.perf_counter() - start))
            else:
                return
    finally:
        client.stop()


def _median_ms(values) -> float:
    return 1e3 * statistics.median(values)


def _publish_and_refresh(publishers: dict, conn: Any, params: Any, trials: int) -> dict:
    """Publishes every bit-width in turn and has the actor process refresh it; per-stage seconds per trial."""
    samples = {bits: [] for bits in BITS}
    version = 0
    for trial in range(trials + 1):  # trial 0 warms up (jit, connections)
        order = BITS[trial % len(BITS):] + BITS[:trial % len(BITS)]
        for bits in order:
            version += 1
            stats = publishers[bits].publish(params, version)
            conn.send(("refresh", version))
            if not conn.poll(120):
                raise TimeoutError(f"actor process did not refresh version {version} in 120 s")
            got_version, nbytes, pull_s, deserialize_s, load_s = conn.recv()
            if got_version != version:
                raise RuntimeError(f"actor refreshed version {got_version}, expected {version}")
            if trial:
                samples[bits].append(dict(
                    publish=stats.quantize_s + stats.serialize_s + stats.insert_s,
                    quantize=stats.quantize_s, serialize=stats.serialize_s,
                    insert=stats.insert_s, pull=pull_s, deserialize=deserialize_s,
                    load=load_s, refresh=pull_s + deserialize_s + load_s, nbytes=nbytes))
    return samples


def _learner_rate(dataset: Any, seconds: float) -> tuple:
    """(batches, elapsed seconds) the learner's dataset serves in about `seconds`, after a warm-up."""
    for _ in range(5):
        next(dataset)
    start, batches = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        next(dataset)
        batches += 1
    return batches, time.perf_counter() - start


def _rows(samples: dict) -> list:
    """One row per bit-width: bytes, median ms per stage, refresh speedup over 32 bits."""
    base = samples[32]
    rows = []
    for bits in BITS:
        s = samples[bits]
        ratios = [b["refresh"] / q["refresh"] for b, q in zip(base, s)]
        rows.append({
            "bits": bits,
            "payload_bytes": s[0]["nbytes"],
            "bytes_vs_32": s[0]["nbytes"] / base[0]["nbytes"],
            **{f"{stage}_ms": _median_ms([x[stage] for x in s])
               for stage in ("publish", "quantize", "serialize", "insert", "pull", "deserialize",
                             "load", "refresh")},
            "refresh_speedup": statistics.median(ratios),
            "trials": len(s),
        })
    return rows


def run(quick: bool) -> dict:
    """Measures everything; returns the JSON report."""
    from actorq_jax.quantization import QuantConfig
    from actorq_jax.replay import (
        ReplayDataset,
        ReplayServer,
        ReplayTableConfig,
        VariablePublisher,
        make_replay_table,
        make_variables_table,
        wait_for_server,
    )

    trials = 4 if quick else 15
    adder_s, learner_s = (3.0, 2.0) if quick else (10.0, 8.0)
    params = policy_params(1)
    configs = {bits: QuantConfig(bits=bits) for bits in BITS}
    replay_config = ReplayTableConfig(max_size=200_000, min_size=BATCH, samples_per_insert=None)
    tables = [make_variables_table(),
              make_replay_table(replay_config, np.zeros(OBS_DIM, np.float32),
                                np.zeros(ACTION_DIM, np.float32))]
    ctx = mp.get_context("spawn")
    with ReplayServer(tables) as server:
        publisher_client = wait_for_server(server.address, 30)
        publishers = {bits: VariablePublisher(publisher_client, "variables", configs[bits]) for bits in BITS}
        conn, child_conn = ctx.Pipe()
        actor = ctx.Process(target=_actor_process, args=(server.address, child_conn, 0), daemon=True)
        actor.start()
        try:
            samples = _publish_and_refresh(publishers, conn, params, trials)
            conn.send(("adder", adder_s))
            if not conn.poll(adder_s + 120):
                raise TimeoutError("actor process did not finish the adder run")
            steps, items, adder_elapsed = conn.recv()
            conn.send(("stop",))
        finally:
            actor.join(timeout=30)
            if actor.is_alive():
                actor.terminate()
                actor.join()

        batches, learner_elapsed = _learner_rate(ReplayDataset(server.address, "replay", batch_size=BATCH), learner_s)

    rows = _rows(samples)
    by_bits = {row["bits"]: row for row in rows}
    return {
        "benchmark": "variables",
        "machine": machine_info(),
        "rows": rows,
        "throughput": {"adder_transitions": items, "adder_env_steps": steps,
                       "adder_seconds": adder_elapsed, "learner_batches": batches,
                       "learner_batch_size": BATCH, "learner_seconds": learner_elapsed},
        "headline": {
            "refresh_speedup_8bit": by_bits[8]["refresh_speedup"],
            "refresh_speedup_4bit": by_bits[4]["refresh_speedup"],
            "adder_transitions_per_s": items / adder_elapsed,
            "learner_batches_per_s": batches / learner_elapsed,
        },
    }


def print_table(report: dict) -> None:
    """The readable table on stdout."""
    print(f"variables: 2048x3 policy, server+publisher and actor in two processes "
          f"({report['rows'][0]['trials']} interleaved trials, medians)")
    header = (f"{'bits':>4} {'payload MB':>10} {'vs 32':>6} {'publish ms':>10} {'pull ms':>8} "
              f"{'deser ms':>8} {'load ms':>8} {'refresh ms':>10} {'speedup':>8}")
    print(header)
    print("-" * len(header))
    for row in report["rows"]:
        print(f"{row['bits']:>4} {row['payload_bytes'] / 1e6:>10.2f} {row['bytes_vs_32']:>6.3f} "
              f"{row['publish_ms']:>10.1f} {row['pull_ms']:>8.1f} {row['deserialize_ms']:>8.1f} "
              f"{row['load_ms']:>8.2f} {row['refresh_ms']:>10.1f} {row['refresh_speedup']:>7.2f}x")
    print("publish = quantize + to_wire + insert: " + ", ".join(
        f"{r['bits']}b {r['quantize_ms']:.1f}+{r['serialize_ms']:.1f}+{r['insert_ms']:.1f} ms"
        for r in report["rows"]))
    t = report["throughput"]
    print(f"adder (n={N_STEP}, one actor process): {report['headline']['adder_transitions_per_s']:.0f} "
          f"transitions/s ({t['adder_transitions']} in {t['adder_seconds']:.1f} s)")
    print(f"learner (batch {BATCH}, server in-process): {report['headline']['learner_batches_per_s']:.1f} "
          f"batches/s ({t['learner_batches']} in {t['learner_seconds']:.1f} s)")
    print("headline: " + ", ".join(f"{k}={v:.2f}" for k, v in report["headline"].items()))


def main() -> None:
    """Parses flags, measures, prints the table and writes --json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials and shorter runs (< 1 min)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON here")
    args = parser.parse_args()
    report = run(args.quick)
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
