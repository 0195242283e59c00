"""Learner SGD step on an accelerator against one CPU core: steps/s, GFLOP/s and the same result.

For each agent (d4pg, dqn) and policy H x3 (its default critic), one worker process per
platform builds the agent's learner state and times its sgd_step on host batches shaped
as the replay dataset serves them (the learner's loop: one step per call, the batch
copied to the device each call) and eight steps per call (multi_sgd_step, a lax.scan over
stacked batches). The CPU worker is pinned to one core, as a learner is on a CPU layout;
the GPU worker has the device. Trials alternate between the workers; figures are medians.
Each case also runs one SGD step from the same state and batch on both platforms and
reports the largest parameter difference relative to the parameters' scale, at
float32 matmul precision "highest" (the GPU's default multiplies float32 in TF32 on
recent NVIDIA chips, which the table also times).

    python benchmarks/learner_gpu.py [--agents d4pg,dqn] [--sizes 256,1024] [--json PATH]

An accelerator machine whose Python has no dm-reverb wheel (Reverb ships CPython 3.9-3.11
only) can still time the step: --without_reverb registers empty modules for those in STAND_INS
where they do not import, which the SGD step never calls, and --spec table gives the agents' specs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

SCAN_STEPS = 8
# Modules that --without_reverb stands in for: Reverb and its TensorFlow, which have no CPython 3.12 wheel.
STAND_INS = ("reverb", "tensorflow")
# The agents' default tasks as (observation_dim, action_dim or None, num_actions or None), for a machine
# without the simulators (a learner node needs none): what environment_spec() reads from them.
DEFAULT_SPECS = {"d4pg": (5, 1, None), "dqn": (4, None, 2)}


def _stand_in_reverb() -> None:
    """Empty modules for those of STAND_INS that do not import, so that the agents import without them."""
    import types


    for name in STAND_INS:
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
    # TFP 0.25's JAX substrate (rlax -> distrax -> TFP) reads this table where jax < 0.5 kept it.
    from jax.interpreters import xla

    if not hasattr(xla, "pytype_aval_mappings"):
        from jax._src import core

        xla.pytype_aval_mappings = core.pytype_aval_mappings


def _builder(agent: str, hidden: int, from_table: bool) -> Any:
    """The agent's builder at H x3, its spec read from its default task or (from_table) DEFAULT_SPECS."""
    import numpy as np
    from learner import POLICY_LAYERS, make_builder

    from actorq_jax.agents.registry import get_agent
    from actorq_jax.environments.spec import EnvironmentSpec

    if not from_table:
        return make_builder(agent, hidden)
    obs, action_dim, num_actions = DEFAULT_SPECS[agent]
    bounds = np.ones(action_dim or 0, np.float32)
    spec = EnvironmentSpec(observation_dim=obs, discrete=num_actions is not None, action_dim=action_dim,
                           num_actions=num_actions, action_minimum=-bounds, action_maximum=bounds)
    entry = get_agent(agent)
    return entry.make_builder(entry.config_class(**{POLICY_LAYERS[agent]: (hidden,) * 3}), spec)


def worker(args: argparse.Namespace) -> int:
    """One platform's side: per case, compile, time each variant per trial on command, and one step's result."""
    if args.without_reverb:
        _stand_in_reverb()
    import jax
    import numpy as np
    from learner import synthetic_batch

    from actorq_jax.agents.multi_step import multi_sgd_step, stack_batches

    try:
        device = jax.devices()[0]
    except RuntimeError as error:  # JAX_PLATFORMS names a platform this jax cannot start
        print(f"learner_gpu: no JAX platform {os.environ.get('JAX_PLATFORMS')!r} on this machine ({error}); "
              "a GPU needs a CUDA build of jax (README: A GPU learner)", file=sys.stderr)
        return 2
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not reach the parent's JSON stream
    cases: Dict[str, Dict[str, Any]] = {}
    for line in sys.stdin:
        command = json.loads(line)
        key = f"{command['agent']}/{command['hidden']}"
        if command["op"] == "setup":
            builder = _builder(command["agent"], command["hidden"], args.spec == "table")
            state = builder.init_state(jax.random.PRNGKey(0))
            batch = synthetic_batch(builder, seed=0)
            lowered = jax.jit(builder.sgd_step).lower(state, batch._replace(keys=None))
            # Newer jax answers None before compiling; the compiled count is then the one there is.
            cost = lowered.cost_analysis() or lowered.compile().cost_analysis()
            flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])
            scan = multi_sgd_step(builder.sgd_step, SCAN_STEPS)
            stacked = stack_batches([synthetic_batch(builder, seed) for seed in range(SCAN_STEPS)])
            with jax.default_matmul_precision("highest"):
                after, _ = jax.jit(builder.sgd_step)(state, batch)
                params = np.concatenate([np.ravel(np.asarray(x, np.float64))
                                         for x in jax.tree_util.tree_leaves(after)
                                         if np.issubdtype(np.asarray(x).dtype, np.floating)])
            variants = {}
            for precision in ("default", "highest"):
                step = jax.jit(builder.sgd_step)
                variants[f"step/{precision}"] = (step, [state], batch, 1, precision)
                variants[f"scan{SCAN_STEPS}/{precision}"] = (scan, [state], stacked, SCAN_STEPS, precision)
            for fn, box, data, _, precision in variants.values():
                with jax.default_matmul_precision(precision):
                    for _ in range(2):
                        box[0], metrics = fn(box[0], data)
                    jax.block_until_ready(metrics)
            cases[key] = {"variants": variants}
            np.save(os.path.join(args.scratch, f"{device.platform}_{command['agent']}_{command['hidden']}.npy"), params)
            reply = {"flops": flops, "device": str(device.device_kind), "platform": device.platform}
        else:
            fn, box, data, steps, precision = cases[key]["variants"][command["variant"]]
            calls, start_cpu, start = 0, time.process_time(), time.perf_counter()
            with jax.default_matmul_precision(precision):
                while calls < 2 or time.perf_counter() - start < command["seconds"]:
                    box[0], metrics = fn(box[0], data)
                    calls += 1
                jax.block_until_ready(metrics)
            wall = time.perf_counter() - start
            reply = {"steps_per_s": calls * steps / wall, "cpu_per_wall": (time.process_time() - start_cpu) / wall}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


class _Worker:
    """A worker subprocess on one platform, driven one JSON line at a time."""

    def __init__(self, platform: str, args: argparse.Namespace, scratch: str):
        self.platform = platform
        env = dict(os.environ, JAX_PLATFORMS=platform, PYTHONUNBUFFERED="1")
        argv = [sys.executable, __file__, "--worker", "--scratch", scratch, "--spec", args.spec]
        if args.without_reverb:
            argv.append("--without_reverb")
        # One core for the CPU learner: XLA sizes its thread pool to the cores the process may use.
        core = max(os.sched_getaffinity(0))
        preexec = (lambda: os.sched_setaffinity(0, {core})) if platform == "cpu" else None
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=preexec)

    def ask(self, **command: Any) -> Dict[str, Any]:
        """Sends one command and returns the worker's reply; RuntimeError if the worker died."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise RuntimeError(f"the {self.platform} worker exited with code {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        """Ends the worker."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:  # the worker died first; its exit code says why
                pass
        self.proc.wait(timeout=60)


def main(argv: Optional[List[str]] = None) -> int:
    """Parses flags, times every case on both platforms, prints the table and the headline as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", default="d4pg,dqn")
    parser.add_argument("--sizes", default="256,1024", help="policy widths H (2048 takes minutes on the CPU side)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0, help="per trial and variant")
    parser.add_argument("--accelerator", default="cuda", help="the JAX platform compared with one CPU core")
    parser.add_argument("--spec", choices=("task", "table"), default="task",
                        help="task: read each agent's spec from its default task; table: DEFAULT_SPECS")
    parser.add_argument("--without_reverb", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    import tempfile

    import numpy as np

    agents = [a for a in args.agents.split(",") if a]
    unknown = [a for a in agents if a not in DEFAULT_SPECS]
    if unknown:
        parser.error(f"--agents: unknown {unknown}; choose from {sorted(DEFAULT_SPECS)}")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        parser.error(f"--sizes: {args.sizes!r} is not a comma-separated list of integers")
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        workers = {p: _Worker(p, args, scratch) for p in ("cpu", args.accelerator)}
        try:
            for agent in agents:
                for hidden in sizes:
                    info = {p: w.ask(op="setup", agent=agent, hidden=hidden) for p, w in workers.items()}
                    cpu_params = np.load(os.path.join(scratch, f"cpu_{agent}_{hidden}.npy"))
                    acc_params = np.load(os.path.join(scratch, f"{info[args.accelerator]['platform']}_{agent}_{hidden}.npy"))
                    difference = float(np.max(np.abs(cpu_params - acc_params)) / np.max(np.abs(cpu_params)))
                    rates: Dict[str, List[float]] = {}
                    for _ in range(args.trials):
                        for variant in ("step/default", "step/highest", f"scan{SCAN_STEPS}/default",
                                        f"scan{SCAN_STEPS}/highest"):
                            for platform, w in workers.items():
                                if platform == "cpu" and variant.endswith("/highest"):
                                    continue  # XLA:CPU multiplies float32 at full precision either way
                                reply = w.ask(op="time", agent=agent, hidden=hidden, variant=variant,
                                              seconds=args.seconds)
                                rates.setdefault(f"{platform}:{variant}", []).append(reply["steps_per_s"])
                    row = {"agent": agent, "hidden": hidden, "gflop_per_step": info["cpu"]["flops"] / 1e9,
                           "accelerator": info[args.accelerator]["device"], "max_rel_param_difference": difference}
                    row.update({k: statistics.median(v) for k, v in rates.items()})
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        except RuntimeError as error:
            print(f"learner_gpu: {error}", file=sys.stderr)
            return 1
        finally:
            for w in workers.values():
                w.close()
    acc = args.accelerator
    print(f"\n| agent | H | GFLOP/step | CPU core steps/s | {acc} steps/s (step, scan{SCAN_STEPS}) "
          f"| {acc} GFLOP/s (scan{SCAN_STEPS}) | {acc}/CPU (scan{SCAN_STEPS}) | highest: {acc} scan{SCAN_STEPS} | max rel diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        r = collections.defaultdict(lambda: float("nan"), row)  # with --accelerator cpu, CPU's highest is not timed
        scan = f"scan{SCAN_STEPS}"
        print(f"| {r['agent']} | {r['hidden']} | {r['gflop_per_step']:.2f} | {r[f'cpu:{scan}/default']:.1f} "
              f"| {r[f'{acc}:step/default']:.0f}, {r[f'{acc}:{scan}/default']:.0f} "
              f"| {r[f'{acc}:{scan}/default'] * r['gflop_per_step']:.0f} "
              f"| {r[f'{acc}:{scan}/default'] / r[f'cpu:{scan}/default']:.1f}x "
              f"| {r[f'{acc}:{scan}/highest']:.0f} | {r['max_rel_param_difference']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
