"""An actor's policy call under XLA:CPU's defaults against two other ways of running it.

- default: JAX 0.4.34's CPU client as every process gets it (asynchronous dispatch of
  expensive calls, XLA's thunk runtime);
- sync: `JAX_CPU_ENABLE_ASYNC_DISPATCH=false`, the call runs inline on the calling
  thread (an actor blocks on every action at once, so a hand-off to another thread
  buys it nothing);
- nothunk: `--xla_cpu_use_thunk_runtime=false`, the runtime XLA:CPU used before the
  thunk runtime (what the learner runs with: agents/learner_xla.py).

Each trial starts one worker process per setting, in alternating order, pinned to one core
with one XLA thread. A worker builds the actor's own pieces (D4PG's batched behaviour policy
on K cartpole_balance environments, the parameter loader of its precision) and runs the
actor's loop without replay: policy call on the [K, obs] batch, K environment steps. It
reports the median wall and CPU microseconds per env step of the policy call and of the
environment step (PhaseTimer, the actors' own timer; CPU is the process clock, all threads).
With --contend, every worker shares its core with a busy process (as an actor shares a core
with the replay service or the learner in the shared layout): wall time well above CPU time
in a phase means the worker lost its core there. Ratios: default time / the setting's time
per env step (> 1: the setting is faster), medians of the per-trial ratios.

    python benchmarks/dispatch.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from actorq_jax.telemetry import write_json
from actorq_jax.telemetry.machine import machine_info

ROOT = Path(__file__).resolve().parents[1]
TASK = "cartpole_balance"
POLICIES = {"256x3": (256, 256, 256), "1024x3": (1024, 1024, 1024)}
BITS = (32, 8)
# Each setting's environment for its worker process (XLA and JAX read them once, at start).
SETTINGS = {
    "default": {},
    "sync": {"JAX_CPU_ENABLE_ASYNC_DISPATCH": "false"},
    "nothunk": {"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=false"},
}
SETTING_NAMES = tuple(SETTINGS)
WORKER_TIMEOUT_S = 600


def _worker(policy: str, bits: int, envs: int, steps: int) -> Dict[str, float]:
    """Times `steps` actor steps in this process; median microseconds per env step of each phase."""
    import jax
    import numpy as np

    from actorq_jax.agents.registry import get_agent
    from actorq_jax.environments import environment_spec
    from actorq_jax.launch import vector_env
    from actorq_jax.launch.precision import ActorPrecision, make_param_loader
    from actorq_jax.quantization import quantize
    from actorq_jax.telemetry import PhaseTimer

    entry = get_agent("d4pg")
    envs_ = vector_env.VectorEnv(TASK, vector_env.env_seeds(0, 0, 0, envs))
    builder = entry.make_builder(entry.config_class(policy_layers=POLICIES[policy]), environment_spec(envs_.envs[0]))
    act = vector_env.make_vector_act(builder.vector_behaviour_policy(0, 1, envs))
    precision = ActorPrecision(actor_bits=bits, comm_bits=bits)
    initial = jax.device_get(builder.init_actor_params(jax.random.PRNGKey(0)))
    params = make_param_loader(precision)(quantize(initial, precision.wire_quant()))
    for k in range(envs):
        envs_.reset(k)
    per_step: Dict[str, List[float]] = {"inference_wall": [], "inference_cpu": [], "env_wall": [], "env_cpu": []}
    timer = PhaseTimer()
    block = 50  # actor steps per sample: one sample is a median's element
    for i in range(steps + 2 * block):  # the first two blocks warm up (compilation, caches)
        with timer.phase("inference"):
            actions = np.asarray(act(params, envs_.keys, i, envs_.observations()))
        with timer.phase("env_step"):
            envs_.step(actions)
            for finished in envs_.finished():
                envs_.reset(finished.env_index)
        if (i + 1) % block == 0:
            wall, cpu = timer.totals(), timer.cpu_totals()
            timer.reset()
            if i >= 2 * block:
                scale = 1e6 / (block * envs)
                per_step["inference_wall"].append(wall["inference"] * scale)
                per_step["inference_cpu"].append(cpu["inference"] * scale)
                per_step["env_wall"].append(wall["env_step"] * scale)
                per_step["env_cpu"].append(cpu["env_step"] * scale)
    return {k: statistics.median(v) for k, v in per_step.items()}


def _busy(core: int) -> subprocess.Popen:
    """A process that keeps `core` busy until killed."""
    code = f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def _trial(setting: str, policy: str, bits: int, envs: int, steps: int, core: int) -> Dict[str, float]:
    """Runs one worker process under `setting`, pinned to `core`; its per-step medians."""
    from actorq_jax.launch.placement import worker_env
    from actorq_jax.launch.runtime import thread_env

    env = {**worker_env(), **thread_env(1), "JAX_PLATFORMS": "cpu"}
    for key, value in SETTINGS[setting].items():
        env[key] = f"{env[key]} {value}" if key == "XLA_FLAGS" and env.get(key) else value
    command = [sys.executable, __file__, "--worker", json.dumps([policy, bits, envs, steps]), "--core", str(core)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{setting} worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _case_name(policy: str, bits: int, contend: bool) -> str:
    return f"{policy}_q{bits}" + ("_contended" if contend else "")


def main(argv: List[str] | None = None) -> int:
    """Measures and prints the table; writes --json when asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one trial of fewer steps, 256x3 at q=8 only: a smoke test")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000, help="timed actor steps per worker")
    parser.add_argument("--envs_per_actor", type=int, default=2)
    parser.add_argument("--contend", choices=("both", "no", "yes"), default="both",
                        help="share the worker's core with a busy process: both (default), no, yes")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--core", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        if args.core is not None:
            os.sched_setaffinity(0, {args.core})
        policy, bits, envs, steps = json.loads(args.worker)
        print(json.dumps(_worker(policy, bits, envs, steps)))
        return 0
    for name in ("trials", "steps", "envs_per_actor"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    trials, steps = (1, 200) if args.quick else (args.trials, args.steps)
    policies = ["256x3"] if args.quick else list(POLICIES)
    bits_list = (8,) if args.quick else BITS
    contends = {"both": [False, True], "no": [False], "yes": [True]}[args.contend]
    core = min(os.sched_getaffinity(0))
    before = machine_info()
    results: Dict[str, List[Dict[str, Dict[str, float]]]] = {}
    for contend in contends:
        busy = _busy(core) if contend else None
        try:
            for trial in range(trials):
                for policy in policies:
                    for bits in bits_list:
                        order = SETTING_NAMES[trial % len(SETTING_NAMES):] + SETTING_NAMES[:trial % len(SETTING_NAMES)]
                        measured = {name: _trial(name, policy, bits, args.envs_per_actor, steps, core) for name in order}
                        results.setdefault(_case_name(policy, bits, contend), []).append(measured)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    rows, headline = [], {}
    print(f"{'case':<26} {'setting':<8} {'infer wall us':>13} {'infer cpu us':>12} {'env wall us':>11} "
          f"{'env cpu us':>10}   (per env step, K={args.envs_per_actor})")
    for case, per_trial in results.items():
        for setting in SETTING_NAMES:
            med = {k: statistics.median(t[setting][k] for t in per_trial) for k in per_trial[0][setting]}
            rows.append({"case": case, "setting": setting, **{f"{k}_us": v for k, v in med.items()}})
            print(f"{case:<26} {setting:<8} {med['inference_wall']:>13.1f} {med['inference_cpu']:>12.1f} "
                  f"{med['env_wall']:>11.1f} {med['env_cpu']:>10.1f}")
        for other in SETTING_NAMES[1:]:
            ratio = statistics.median(t["default"]["inference_wall"] / t[other]["inference_wall"] for t in per_trial)
            step = statistics.median((t["default"]["inference_wall"] + t["default"]["env_wall"])
                                     / (t[other]["inference_wall"] + t[other]["env_wall"]) for t in per_trial)
            headline[f"inference_default_over_{other}_{case}"] = ratio
            headline[f"step_default_over_{other}_{case}"] = step
    print("\ndefault / setting wall time per env step (> 1: the setting is faster):")
    for key, value in headline.items():
        print(f"  {key:<52} {value:.2f}")
    report = {"benchmark": "dispatch", "machine": {**before, "loadavg_after": machine_info()["loadavg_1_5_15"]},
              "envs_per_actor": args.envs_per_actor, "trials": trials, "steps": steps, "rows": rows,
              "headline": headline}
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
