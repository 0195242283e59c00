"""What an item costs the replay service, by the adder's chunk length: memory, checkpoint, insert and sample CPU.

A replay service (the project's ReplayServer, with a checkpoint directory) runs in a
process of its own; this process writes D4PG cartpole_balance-shaped n-step
transitions into it through the actors' NStepAdder (1000-step episodes), then
samples batches of 256 as the learner does (the agent's ReplayDataset) and asks
the service for a checkpoint. For each chunk length (--chunk_lengths, default 1,
the one-step chunks of an adder that creates every item at once, and 16, the
adder's default) and each trial, in alternating order, it records:

  adder us/step      this process's CPU per env step while writing (the actor's side)
  service us/step    the service's CPU per env step while taking those writes
  KB/item            the service's resident memory per item once --items are in
  sample ms          CPU per batch of 256: this process (the learner's side) and the service
  checkpoint s       wall time of one checkpoint of the full table (the service answers
                     nothing else meanwhile)

CPU is read from /proc (the service) and process_time (this process), so a busy
machine shifts it less than wall time. Figures are medians over trials, ratios
medians of per-trial ratios against the first chunk length (> 1: the longer
chunks are cheaper).

    python benchmarks/replay.py [--quick] [--items 200000] [--chunk_lengths 1,16] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import psutil

from actorq_jax.telemetry.machine import machine_info

TASK = "cartpole_balance"
EPISODE_STEPS = 1000
SAMPLE_BATCHES = 100
WARMUP_BATCHES = 10


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _proc_rss_bytes(pid: int) -> int:
    """Resident memory of process `pid`."""
    return psutil.Process(pid).memory_info().rss


def _builder() -> Any:
    """D4PG's builder for TASK (its replay table and dataset)."""
    from actorq_jax.agents.registry import get_agent
    from actorq_jax.environments import environment_spec, make_environment

    entry = get_agent("d4pg")
    return entry.make_builder(entry.config_class(), environment_spec(make_environment(TASK, seed=0)))


def _serve(address_queue: Any, max_size: int, checkpoint_dir: str) -> None:
    """The replay service process: the agent's table without a rate limiter, until killed."""
    from actorq_jax.replay import ReplayServer

    builder = _builder()
    table = dataclasses.replace(builder.replay_config(), samples_per_insert=None, max_times_sampled=0,
                                min_size=builder.batch_size, max_size=max_size)
    server = ReplayServer(builder.replay_tables(table), checkpoint_dir=Path(checkpoint_dir))
    address_queue.put(server.address)
    while True:
        time.sleep(3600)


def measure(chunk_length: int, items: int) -> Dict[str, float]:
    """One trial at one chunk length: a fresh service filled with `items` transitions."""
    import dm_env
    import numpy as np
    import reverb

    from actorq_jax.replay import NStepAdder, wait_for_server

    builder = _builder()
    config = builder.adder_config()
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(EPISODE_STEPS + 1, builder.spec.observation_dim)).astype(np.float32)
    actions = rng.uniform(-1, 1, size=(EPISODE_STEPS,) + builder.example_action().shape).astype(np.float32)
    rewards = rng.uniform(size=EPISODE_STEPS)
    workdir = tempfile.mkdtemp(prefix="actorq-replay-bench-")
    context = mp.get_context("spawn")
    queue = context.Queue()
    service = context.Process(target=_serve, args=(queue, items + EPISODE_STEPS, workdir), daemon=True)
    service.start()
    try:
        address = queue.get(timeout=120)
        client = wait_for_server(address, 60)
        rss_empty = _proc_rss_bytes(service.pid)
        adder = NStepAdder(client, config.table, config.n_step, config.discount, chunk_length=chunk_length)
        written = 0
        cpu0, service0 = time.process_time(), _proc_cpu_s(service.pid)
        while written < items:
            adder.add_first(dm_env.restart(obs[0]))
            for t in range(EPISODE_STEPS):
                end = dm_env.truncation if t == EPISODE_STEPS - 1 else dm_env.transition
                adder.add(actions[t], end(float(rewards[t]), obs[t + 1]))
            written += EPISODE_STEPS
        adder.close()
        write_cpu, write_service = time.process_time() - cpu0, _proc_cpu_s(service.pid) - service0
        stored = client.server_info(timeout=30)[config.table].current_size
        rss_full = _proc_rss_bytes(service.pid)

        dataset = builder.make_dataset(address, rate_limiter_timeout_ms=-1)
        for _ in range(WARMUP_BATCHES):
            next(dataset)
        cpu0, service0 = time.process_time(), _proc_cpu_s(service.pid)
        for _ in range(SAMPLE_BATCHES):
            next(dataset)
        sample_cpu, sample_service = time.process_time() - cpu0, _proc_cpu_s(service.pid) - service0
        del dataset

        start = time.perf_counter()
        reverb.Client(address).checkpoint()
        checkpoint_s = time.perf_counter() - start
    finally:
        service.kill()
        service.join(30)
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "chunk_length": chunk_length, "items": stored,
        "adder_us_per_step": 1e6 * write_cpu / written,
        "service_us_per_step": 1e6 * write_service / written,
        "service_kb_per_item": (rss_full - rss_empty) / 1024 / stored,
        "learner_sample_ms_per_batch": 1e3 * sample_cpu / SAMPLE_BATCHES,
        "service_sample_ms_per_batch": 1e3 * sample_service / SAMPLE_BATCHES,
        "checkpoint_s": checkpoint_s,
    }


METRICS = ("adder_us_per_step", "service_us_per_step", "service_kb_per_item", "learner_sample_ms_per_batch",
           "service_sample_ms_per_batch", "checkpoint_s")


def run(chunk_lengths: List[int], items: int, trials: int) -> Dict[str, Any]:
    """Every chunk length once per trial, in alternating order; medians and per-trial ratios."""
    load_before = [round(v, 2) for v in os.getloadavg()]
    trials_rows: List[List[Dict[str, float]]] = []
    for trial in range(trials):
        order = chunk_lengths if trial % 2 == 0 else list(reversed(chunk_lengths))
        by_length = {length: measure(length, items) for length in order}
        trials_rows.append([by_length[length] for length in chunk_lengths])
    rows = []
    for k, length in enumerate(chunk_lengths):
        row: Dict[str, Any] = {"chunk_length": length, "trials": trials,
                               "items": statistics.median(t[k]["items"] for t in trials_rows)}
        for metric in METRICS:
            row[metric] = statistics.median(t[k][metric] for t in trials_rows)
            # How many times cheaper than the first chunk length, the median of per-trial ratios.
            row[metric + "_ratio"] = statistics.median(t[0][metric] / t[k][metric] for t in trials_rows)
        rows.append(row)
    headline = {}
    if 16 in chunk_lengths and chunk_lengths[0] == 1:
        longer = rows[chunk_lengths.index(16)]
        headline = {"replay_memory_ratio_chunk16": longer["service_kb_per_item_ratio"],
                    "replay_checkpoint_speedup_chunk16": longer["checkpoint_s_ratio"],
                    "replay_service_sample_cpu_ratio_chunk16": longer["service_sample_ms_per_batch_ratio"],
                    "replay_service_insert_cpu_ratio_chunk16": longer["service_us_per_step_ratio"]}
    return {"benchmark": "replay", "machine": {**machine_info(), "load_before": load_before,
                                               "load_after": [round(v, 2) for v in os.getloadavg()]},
            "task": TASK, "rows": rows, "headline": headline}


def print_table(report: Dict[str, Any]) -> None:
    """The readable table on stdout."""
    rows = report["rows"]
    print(f"replay: D4PG {report['task']} transitions, service in its own process, "
          f"{rows[0]['items']:.0f} items, {rows[0]['trials']} trials (medians; x: times cheaper than chunk "
          f"{rows[0]['chunk_length']})")
    header = (f"{'chunk':>5} {'adder us/step':>14} {'service us/step':>16} {'KB/item':>12} "
              f"{'sample ms learner':>18} {'sample ms service':>18} {'checkpoint s':>14}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['chunk_length']:>5} {r['adder_us_per_step']:>7.1f} {r['adder_us_per_step_ratio']:>5.2f}x "
              f"{r['service_us_per_step']:>9.1f} {r['service_us_per_step_ratio']:>5.2f}x "
              f"{r['service_kb_per_item']:>5.2f} {r['service_kb_per_item_ratio']:>5.2f}x "
              f"{r['learner_sample_ms_per_batch']:>11.2f} {r['learner_sample_ms_per_batch_ratio']:>5.2f}x "
              f"{r['service_sample_ms_per_batch']:>11.2f} {r['service_sample_ms_per_batch_ratio']:>5.2f}x "
              f"{r['checkpoint_s']:>7.2f} {r['checkpoint_s_ratio']:>5.2f}x")
    m = report["machine"]
    print(f"machine: {m.get('cpu')} ({m.get('cores')} cores), load {m['load_before']} -> {m['load_after']}")
    if report["headline"]:
        print("headline: " + ", ".join(f"{k}={v:.2f}" for k, v in report["headline"].items()))


def _lengths(text: str, parser: argparse.ArgumentParser) -> List[int]:
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        parser.error(f"--chunk_lengths: {text!r}; expected comma-separated ints >= 1, like 1,16")
    if not lengths or min(lengths) < 1 or len(set(lengths)) != len(lengths):
        parser.error(f"--chunk_lengths: {text!r}; expected distinct ints >= 1, like 1,16")
    return lengths


def main() -> None:
    """Parses flags, measures, prints the table and writes --json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5,000 items, 2 trials (under a minute)")
    parser.add_argument("--items", type=int, default=200_000, help="transitions written per trial")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--chunk_lengths", default="1,16", help="adder chunk lengths, the first the reference")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON here")
    args = parser.parse_args()
    lengths = _lengths(args.chunk_lengths, parser)
    items, trials = (5_000, 2) if args.quick else (args.items, args.trials)
    if items < EPISODE_STEPS or trials < 1:
        parser.error(f"--items must be >= {EPISODE_STEPS} and --trials >= 1, got {items} and {trials}")
    report = run(lengths, items, trials)
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
