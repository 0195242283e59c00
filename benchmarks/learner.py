"""Learner SGD step: steps/s of every agent's pure sgd_step on one thread, synthetic and from a live Reverb table.

For each agent (d4pg, dqn) and policy H x3 (H = 256, 1024, 2048: D4PG's policy with
its default critic, DQN's Q-network) on its default task, one worker process per
XLA option (XLA's defaults, and the flags a learner process runs with:
agents/learner_xla.py; more with --xla_option) runs on one core with XLA's
single-thread settings (runtime.thread_env(1)) and times, on command, these variants of the SGD step:

  step    builder.sgd_step on a host batch, one step per call: the learner today
  donate  multi_sgd_step(sgd_step, 1, donate=True): the state's buffers reused
  scan8   multi_sgd_step(sgd_step, 8): eight steps per jitted call
  live    next(ReplayDataset) + builder.sgd_step (+ the priority write-back for a
          prioritized agent), sampling over gRPC from a filled Reverb table that
          this script serves on 127.0.0.1, as a replay service does; the
          dataset's threads share the worker's core
  matmul  a 2048x2048 float32 jnp.dot: one core's GFLOP/s, the limit

The workers stay up and take turns, so every trial times every (option, variant)
pair in a rotating interleaved order; figures are medians over trials after a
warm-up, ratios the median of per-trial ratios. Each timing also takes the
worker's CPU seconds: steps per CPU second is what the step does with the core
it got, which a loaded machine shares out unevenly; cpu/wall (1 on a quiet
machine; the live variant's sampling threads add to it) says how far the two
differ. FLOPs per SGD step are XLA's cost analysis of the step as JAX lowers it;
the flops fraction is step FLOPs x steps per CPU second over the default
option's matmul GFLOP per CPU second, measured in the same trials.

    python benchmarks/learner.py [--quick] [--json PATH] [--agents d4pg,dqn] [--sizes 256,1024,2048]
    python benchmarks/learner.py --quick --xla_option vw512='--xla_cpu_prefer_vector_width=512'   # one more option

--quick: the 256x3 cases only, 2 trials of 0.2 s (under a minute on a quiet machine).

TensorBoard export runs in the launcher's process, not the learner's: what it can cost the learner is
the CPU it takes from a shared core. This script times that CPU per learner.csv row (the follower and
event writer of actorq_jax.telemetry.tensorboard) and states it as a fraction of the CPU of the
LOG_EVERY_STEPS SGD steps each row stands for (D4PG 256x3, default options).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, NoReturn, Optional, Tuple

from actor_inference import report, time_calls

from actorq_jax.agents.learner_xla import learner_xla_flags
from actorq_jax.agents.registry import get_agent
from actorq_jax.launch.placement import worker_env
from actorq_jax.launch.runtime import exit_now, thread_env
from actorq_jax.telemetry.machine import machine_info

AGENTS = ("d4pg", "dqn")
SIZES = (256, 1024, 2048)
# The config field that sizes each agent's actor network (the "policy" of the paper's sizes).
POLICY_LAYERS = {"d4pg": "policy_layers", "dqn": "q_layers"}
# Each option runs in a worker of its own: XLA reads its flags once, when it starts.
# "learner": the flags a learner process runs with (launch/worker.py applies learner_xla_flags); "default": XLA's own.
OPTIONS = {"default": "", "learner": learner_xla_flags("")}
SCAN_STEPS = 8
VARIANTS = ("step", "donate", f"scan{SCAN_STEPS}", "live")
MATMUL_N = 2048
FILL_ITEMS, QUICK_FILL_ITEMS = 20_000, 1_000
REPLY_TIMEOUT_S = 900  # a 2048x3 compile or trial takes well under this; a hung worker must not stall the run


# -- shared by both sides -----------------------------------------------------------------------------------


def worker_core() -> int:
    """The core every worker is pinned to: the last one this process may use."""
    return max(os.sched_getaffinity(0))


def make_builder(agent: str, hidden: int) -> Any:
    """The agent's builder for its default task, with its actor network at H x3 (imports jax)."""
    from actorq_jax.environments import environment_spec, make_environment

    entry = get_agent(agent)
    spec = environment_spec(make_environment(entry.default_task, seed=0))
    return entry.make_builder(entry.config_class(**{POLICY_LAYERS[agent]: (hidden,) * 3}), spec)


# -- worker side (the parent sets the thread flags before jax starts here) --------------------------------------


# A timed way of running SGD steps: dispatches some, returning (how many, a value to wait on for them).
Advance = Callable[[], Tuple[int, Any]]


def synthetic_batch(builder: Any, seed: int) -> Any:
    """A batch shaped as ReplayDataset(with_info=True) serves it: host numpy arrays, uniform sampling info."""
    import numpy as np

    from actorq_jax.replay import ReplayBatch, Transition

    size, spec = builder.batch_size, builder.spec
    rng = np.random.default_rng(seed)
    if spec.discrete:
        action = rng.integers(0, spec.num_actions, size=size).astype(builder.example_action().dtype)
    else:
        action = rng.uniform(spec.action_minimum, spec.action_maximum, size=(size, spec.action_dim)).astype(np.float32)
    data = Transition(
        observation=rng.standard_normal((size, spec.observation_dim), dtype=np.float32),
        action=action,
        reward=rng.standard_normal(size, dtype=np.float32),
        discount=np.full(size, 0.99**5, np.float32),
        next_observation=rng.standard_normal((size, spec.observation_dim), dtype=np.float32),
    )
    return ReplayBatch(data=data, keys=np.arange(size, dtype=np.uint64), probabilities=np.full(size, 1.0 / size),
                       table_size=np.full(size, size, np.int64))


def _fill(client: Any, builder: Any, items: int, seed: int) -> None:
    """Writes `items` transitions of 200-step episodes through the actors' NStepAdder (rows of a random batch)."""
    import dm_env

    from actorq_jax.replay import NStepAdder

    adder_config = builder.adder_config()
    rows = synthetic_batch(builder, seed).data
    size = builder.batch_size
    with NStepAdder(client, adder_config.table, adder_config.n_step, adder_config.discount) as adder:
        t = 0
        while adder.items_written < items:
            adder.add_first(dm_env.restart(rows.observation[t % size]))
            for k in range(200):
                row = (t + k) % size
                step = dm_env.transition if k < 199 else dm_env.truncation
                adder.add(rows.action[row], step(float(rows.reward[row]), rows.next_observation[row]))
            t += 200


class _Worker:
    """Builds one (agent, size) case at a time and times its variants on command."""

    def __init__(self) -> None:
        self.replay: Dict[str, Tuple[Any, Any]] = {}  # server address -> (client, dataset)
        self.variants: Dict[str, Advance] = {}

    def _live(self, address: str, builder: Any) -> Tuple[Any, Any]:
        """(client, dataset) of the replay table at `address`, built once per server."""
        from actorq_jax.replay import wait_for_server

        if address not in self.replay:
            # As the learner builds it (the agent's dataset), but waiting on the rate limiter for as long as it takes.
            dataset = builder.make_dataset(address, rate_limiter_timeout_ms=-1)
            self.replay[address] = (wait_for_server(address, 30), dataset)
        return self.replay[address]

    def setup(self, agent: str, hidden: int, address: str) -> Dict[str, Any]:
        """Builds the agent at H x3, compiles every variant (two warm-up calls each); the step's FLOPs.

        The live variant samples the replay table the parent serves at `address`.
        """
        import jax
        import jax.numpy as jnp

        from actorq_jax.agents.multi_step import multi_sgd_step, stack_batches

        self.variants = {}  # frees the previous case's states before building this one
        start = time.perf_counter()
        builder = make_builder(agent, hidden)
        initial = builder.init_state(jax.random.PRNGKey(0))
        batch = synthetic_batch(builder, seed=0)
        client, dataset = self._live(address, builder)
        feedback = builder.priority_feedback()  # the learner's write-back (None: uniform replay)

        # FLOPs of the step as JAX lowers it, before XLA's passes: the same count under every XLA option
        # (the compiled count misses the dots the non-thunk runtime hands to Eigen).
        cost = jax.jit(builder.sgd_step).lower(initial, batch._replace(keys=None)).cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = float(cost["flops"])

        def fresh() -> Any:
            # Each variant trains its own copy: a donating one deletes the buffers it is given.
            return jax.tree_util.tree_map(jnp.copy, initial)

        def one_step(state_box: List[Any], step: Callable, stacked: Any, steps: int) -> Advance:
            def advance() -> Tuple[int, Any]:
                state_box[0], metrics = step(state_box[0], stacked)
                return steps, metrics
            return advance

        def live_step(state_box: List[Any]) -> Advance:
            def advance() -> Tuple[int, Any]:
                sampled = next(dataset)
                state_box[0], metrics = builder.sgd_step(state_box[0], sampled)
                if feedback is not None:
                    feedback.write_back(client, sampled, metrics)
                return 1, metrics
            return advance

        scan = stack_batches([synthetic_batch(builder, seed) for seed in range(SCAN_STEPS)])
        self.variants = {
            "step": one_step([fresh()], builder.sgd_step, batch, 1),
            "donate": one_step([fresh()], multi_sgd_step(builder.sgd_step, 1, donate=True), stack_batches([batch]), 1),
            f"scan{SCAN_STEPS}": one_step([fresh()], multi_sgd_step(builder.sgd_step, SCAN_STEPS), scan, SCAN_STEPS),
            "live": live_step([fresh()]),
        }
        for advance in self.variants.values():
            for _ in range(2):
                jax.block_until_ready(advance()[1])
        return {"flops_per_step": flops, "setup_s": time.perf_counter() - start, "batch_size": builder.batch_size}

    def measure(self, variant: str, seconds: float) -> Dict[str, float]:
        """SGD steps of a variant over at least `seconds` and two calls (at most two in flight), and the times taken."""
        import jax

        advance = self.variants[variant]
        steps, calls, pending = 0, 0, None
        start_cpu, start = time.process_time(), time.perf_counter()
        while True:
            done, value = advance()
            # Waiting on the previous call keeps the next one dispatched while this one runs, as
            # in the learner's loop, without queueing more work than the window measures.
            if pending is not None:
                jax.block_until_ready(pending)
            pending, steps, calls = value, steps + done, calls + 1
            if calls >= 2 and time.perf_counter() - start >= seconds:
                jax.block_until_ready(pending)
                return {"work": steps, "wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - start_cpu}

    def matmul(self, seconds: float) -> Dict[str, float]:
        """GFLOP of MATMUL_N square float32 jnp.dots over at least `seconds`, and the times taken."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        a = jnp.asarray(np.random.default_rng(0).standard_normal((MATMUL_N, MATMUL_N), dtype=np.float32))
        dot = jax.jit(jnp.dot)
        dot(a, a).block_until_ready()
        start_cpu, start = time.process_time(), time.perf_counter()
        per_call = time_calls(lambda: dot(a, a).block_until_ready(), seconds)
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        return {"work": 2 * MATMUL_N**3 / 1e9 * wall / per_call, "wall_s": wall, "cpu_s": cpu}


def serve() -> NoReturn:
    """The worker loop: one JSON command per stdin line, one JSON reply per line on the original stdout."""
    # One core, before jax starts: XLA sizes its thread pool to the cores it may use, and with more
    # than one the default runtime runs independent ops and split elementwise loops on several
    # threads whatever --xla_cpu_multi_thread_eigen says.
    os.sched_setaffinity(0, {worker_core()})
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the libraries print goes to stderr, not into the replies
    worker = _Worker()
    for line in sys.stdin:
        command = json.loads(line)
        name = command.pop("cmd")
        if name == "quit":
            break
        try:
            reply = getattr(worker, name)(**command)
        except Exception:  # reported to the parent, which skips what failed
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    # The live variant's Reverb sampler threads, left waiting on a server the parent has stopped, would hold
    # the interpreter's teardown for seconds to a minute.
    exit_now(0)


# -- parent side -------------------------------------------------------------------------------------------------


class _WorkerProcess:
    """A worker subprocess for one XLA option: XLA on one thread plus that option's flags."""

    def __init__(self, option: str, flags: str):
        self.option = option
        env = worker_env({"JAX_PLATFORMS": "cpu"})
        env.update(thread_env(1))
        env["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), flags,
                                                thread_env(1)["XLA_FLAGS"]) if f)
        self.xla_flags = env["XLA_FLAGS"]
        self.log = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, os.path.abspath(__file__), "--worker", option]
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log, text=True)

    def send(self, **command: Any) -> None:
        """Sends a command without waiting for its reply."""
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def receive(self) -> Dict[str, Any]:
        """The next reply; {'error': ...} when the worker died, hung or failed."""
        ready, _, _ = select.select([self.process.stdout], [], [], REPLY_TIMEOUT_S)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.log.seek(0)
            return {"error": f"worker {self.option} gave no reply (exit {self.process.poll()}):\n"
                             + self.log.read()[-3000:]}
        return json.loads(line)

    def ask(self, **command: Any) -> Dict[str, Any]:
        """Sends a command and waits for its reply."""
        self.send(**command)
        return self.receive()

    def close(self) -> None:
        """Asks the worker to stop; kills it if it does not."""
        if self.process.poll() is None:
            try:
                self.send(cmd="quit")
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.log.close()


def serve_replay(agent: str, items: int) -> Any:
    """A Reverb server on 127.0.0.1 holding the agent's replay table, filled with `items` transitions.

    The agent's own table (sampler, remover), without its rate limiter: the table is filled once,
    and the benchmark times sampling, not waiting for actors. It runs in this process, as the replay
    service runs beside the learner's, so the workers sample over gRPC.
    """
    from actorq_jax.replay import ReplayServer, wait_for_server

    builder = make_builder(agent, 8)  # the table does not depend on the network's size
    table = dataclasses.replace(builder.replay_config(), samples_per_insert=None, max_times_sampled=0,
                                min_size=builder.batch_size, max_size=items + 1000)
    server = ReplayServer(builder.replay_tables(table), advertised_host="127.0.0.1")
    _fill(wait_for_server(server.address, 30), builder, items, seed=1)
    return server


def _median_ratio(numerator: List[float], denominator: List[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerator, denominator))


def measure_case(workers: Dict[str, _WorkerProcess], agent: str, hidden: int, address: str, trials: int,
                 seconds: float) -> List[Dict[str, Any]]:
    """Every (option, variant) of one case, interleaved over trials; one row each (matmul rows included)."""
    for worker in workers.values():  # the workers compile side by side
        worker.send(cmd="setup", agent=agent, hidden=hidden, address=address)
    setups = {option: worker.receive() for option, worker in workers.items()}
    live = [option for option, setup in setups.items() if "error" not in setup]
    for option, setup in setups.items():
        if "error" in setup:
            print(f"{agent} {hidden}x3 ({option}): setup failed:\n{setup['error']}", file=sys.stderr)
    print(f"{agent} {hidden}x3: set up in " + ", ".join(f"{o} {setups[o]['setup_s']:.1f} s" for o in live),
          file=sys.stderr)
    pairs = [(option, variant) for option in live for variant in VARIANTS + ("matmul",)]
    samples: Dict[Tuple[str, str], List[Dict[str, float]]] = {pair: [] for pair in pairs}
    for trial in range(trials):
        order = pairs[trial % len(pairs):] + pairs[:trial % len(pairs)]
        for option, variant in order:
            if variant == "matmul":
                reply = workers[option].ask(cmd="matmul", seconds=seconds)
            else:
                reply = workers[option].ask(cmd="measure", variant=variant, seconds=seconds)
            if "error" in reply:
                print(f"{agent} {hidden}x3 {option} {variant}: {reply['error']}", file=sys.stderr)
                reply = {"work": float("nan"), "wall_s": 1.0, "cpu_s": 1.0}
            samples[(option, variant)].append(reply)
    if "default" not in live:
        return []
    # Per trial: work per wall second, and per CPU second of the worker (what the step got of the
    # core on a loaded machine; on a quiet one the two agree and cpu/wall is 1).
    wall = {pair: [s["work"] / s["wall_s"] for s in values] for pair, values in samples.items()}
    cpu = {pair: [s["work"] / s["cpu_s"] for s in values] for pair, values in samples.items()}
    limit = statistics.median(cpu[("default", "matmul")])
    rows = []
    for option, variant in pairs:
        pair = (option, variant)
        row = {"agent": agent, "task": get_agent(agent).default_task, "hidden": hidden, "xla": option,
               "variant": variant, "trials": trials,
               "cpu_per_wall": round(statistics.median(s["cpu_s"] / s["wall_s"] for s in samples[pair]), 2)}
        if variant == "matmul":
            row.update(matmul_gflops=round(statistics.median(wall[pair]), 1),
                       matmul_gflops_per_cpu_s=round(statistics.median(cpu[pair]), 1),
                       of_default_matmul=round(statistics.median(cpu[pair]) / limit, 3))
        else:
            flops = setups[option]["flops_per_step"] / 1e9
            per_cpu_s = statistics.median(cpu[pair])
            row.update(sgd_per_s=round(statistics.median(wall[pair]), 2),
                       vs_default_step=round(_median_ratio(wall[pair], wall[("default", "step")]), 3),
                       sgd_per_cpu_s=round(per_cpu_s, 2),
                       vs_default_step_cpu=round(_median_ratio(cpu[pair], cpu[("default", "step")]), 3),
                       **({} if ("learner", "step") not in wall else {
                           "vs_learner_step": round(_median_ratio(wall[pair], wall[("learner", "step")]), 3),
                           "vs_learner_step_cpu": round(_median_ratio(cpu[pair], cpu[("learner", "step")]), 3)}),
                       gflop_per_step=round(flops, 4), gflops=round(flops * statistics.median(wall[pair]), 1),
                       gflops_per_cpu_s=round(flops * per_cpu_s, 1), flops_fraction=round(flops * per_cpu_s / limit, 3),
                       batch_size=setups[option]["batch_size"])
        rows.append(row)
    return rows


def _find(rows: List[Dict[str, Any]], agent: str, hidden: int, option: str, variant: str) -> Optional[Dict[str, Any]]:
    for row in rows:
        if (row["agent"], row["hidden"], row["xla"], row["variant"]) == (agent, hidden, option, variant):
            return row
    return None


def headline(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The headline figures (D4PG, 256x3, as a learner process runs it) and each optimisation's ratio to the one-step
    call."""
    figures: Dict[str, Any] = {}

    def put(key: str, option: str, variant: str, field: str) -> None:
        row = _find(rows, "d4pg", 256, option, variant)
        figures[key] = None if row is None else row[field]

    # What a learner does by default: the step under the learner's XLA flags.
    put("learner_sgd_per_s_256x3", "learner", "step", "sgd_per_s")
    put("learner_flops_fraction_256x3", "learner", "step", "flops_fraction")
    put("learner_sampling_overhead_256x3", "learner", "live", "vs_learner_step")
    # The optimisations compute on one thread: their ratios are per CPU second, robust to a loaded machine.
    put("learner_donate_speedup_256x3", "learner", "donate", "vs_learner_step_cpu")
    put(f"learner_scan{SCAN_STEPS}_speedup_256x3", "learner", f"scan{SCAN_STEPS}", "vs_learner_step_cpu")
    put("learner_flags_speedup_256x3", "learner", "step", "vs_default_step_cpu")  # the learner's flags vs XLA's
    put("learner_flops_fraction_256x3_xla_default", "default", "step", "flops_fraction")
    put("matmul_gflops_per_cpu_s", "default", "matmul", "matmul_gflops_per_cpu_s")
    return figures


def print_table(rows: List[Dict[str, Any]], machine: Dict[str, Any]) -> None:
    """The readable table on stdout."""
    print(f"learner: SGD steps on one XLA thread, medians over {rows[0]['trials'] if rows else 0} interleaved trials; "
          f"{machine['cpu']}, {machine['cores']} cores, load (1 min) before / after: "
          f"{machine['loadavg_before_1_5_15'][0]:.2f} / {machine['loadavg_1_5_15'][0]:.2f}")
    print("| agent | H | xla | variant | steps/s | vs step | steps/cpu-s | vs step (cpu) | GFLOP/step "
          "| GFLOP/cpu-s | of matmul | cpu/wall |")
    print("|" + " --- |" * 12)
    for r in rows:
        if r["variant"] == "matmul":
            print(f"| {r['agent']} | {r['hidden']} | {r['xla']} | matmul {MATMUL_N} | | | | | "
                  f"| {r['matmul_gflops_per_cpu_s']:.1f} | {r['of_default_matmul']:.2f} | {r['cpu_per_wall']:.2f} |")
        else:
            print(f"| {r['agent']} | {r['hidden']} | {r['xla']} | {r['variant']} | {r['sgd_per_s']:.2f} "
                  f"| {r['vs_default_step']:.2f}x | {r['sgd_per_cpu_s']:.2f} | {r['vs_default_step_cpu']:.2f}x "
                  f"| {r['gflop_per_step']:.3f} | {r['gflops_per_cpu_s']:.1f} | {r['flops_fraction']:.2f} "
                  f"| {r['cpu_per_wall']:.2f} |")


def tensorboard_cpu_per_row(trials: int, rows_per_trial: int = 200) -> float:
    """Median CPU seconds the TensorBoard export spends on one learner.csv row (a D4PG row's width)."""
    from actorq_jax.run_dir import RunDir
    from actorq_jax.telemetry import CsvLogger
    from actorq_jax.telemetry.tensorboard import RunScalars

    fields = ["learner_steps", "wall_seconds", "env_steps", "sgd_steps_per_s", "cpu_s_per_step", "publish_s",
              "publish_bytes", "versions_published", "versions_dropped", "critic_loss", "critic_grad_norm",
              "policy_loss", "policy_grad_norm", "q_mean"]
    costs = []
    for _ in range(trials):
        with tempfile.TemporaryDirectory() as tmp:
            logger = CsvLogger(RunDir(tmp).learner_csv, fields, flush_every_s=0)
            for i in range(rows_per_trial):
                logger.write({name: float(i) + 0.5 for name in fields} | {"learner_steps": 100 * (i + 1)})
            logger.close()
            scalars = RunScalars(tmp)
            start = time.thread_time()
            assert scalars.poll() == rows_per_trial
            costs.append((time.thread_time() - start) / rows_per_trial)
            scalars.close()
    return statistics.median(costs)


def _names(parser: argparse.ArgumentParser, flag: str, text: str, known: Tuple[Any, ...],
           kind: type) -> Tuple[Any, ...]:
    """The comma list `text` of --flag as `kind` values, each one of `known`; a usage error (exit 2) otherwise."""
    words = [v.strip() for v in text.split(",") if v.strip()]
    try:
        values = tuple(kind(v) for v in words)
    except ValueError:
        values = ()
    unknown = [v for v in values if v not in known]
    if not values or unknown:
        parser.error(f"--{flag}: {text!r}; choose a comma list from {', '.join(map(str, known))}")
    return values


def main(argv: Optional[List[str]] = None) -> int:
    """Starts one worker per XLA option, measures every case interleaved, prints the table, writes --json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256x3 only, 2 short trials (under a minute)")
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--agents", default=",".join(AGENTS), help="comma list of agents")
    parser.add_argument("--sizes", default=None, help="comma list of hidden sizes H of the H x3 policy")
    parser.add_argument("--xla_option", action="append", default=[], metavar="NAME=FLAGS",
                        help="another XLA option to time beside the default ones, e.g. "
                             "vw512='--xla_cpu_use_thunk_runtime=false --xla_cpu_prefer_vector_width=512' (repeatable)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a worker's option name
    args = parser.parse_args(argv)
    if args.worker is not None:
        serve()
    options = dict(OPTIONS)
    for text in args.xla_option:
        name, _, flags = text.partition("=")
        if not name.isidentifier() or name in options or not flags.strip().startswith("--"):
            parser.error(f"--xla_option: {text!r}; expected NAME=FLAGS with a new NAME and flags like --xla_cpu_...")
        options[name] = flags.strip()

    agents = _names(parser, "agents", args.agents, AGENTS, str)
    sizes = _names(parser, "sizes", args.sizes, SIZES, int) if args.sizes else ((256,) if args.quick else SIZES)
    trials, seconds = (2, 0.2) if args.quick else (7, 1.0)
    load_before = [round(v, 2) for v in os.getloadavg()]
    workers = {option: _WorkerProcess(option, flags) for option, flags in options.items()}
    rows: List[Dict[str, Any]] = []
    try:
        for agent in agents:
            server = serve_replay(agent, QUICK_FILL_ITEMS if args.quick else FILL_ITEMS)
            try:
                for hidden in sizes:
                    rows.extend(measure_case(workers, agent, hidden, server.address, trials, seconds))
            finally:
                server.stop()
    finally:
        for worker in workers.values():
            worker.close()
    figures = headline(rows)
    from actorq_jax.launch.learner import LOG_EVERY_STEPS

    row_cpu_s = tensorboard_cpu_per_row(trials)
    step = _find(rows, "d4pg", 256, "learner", "step")
    figures["tensorboard_cpu_s_per_learner_row"] = row_cpu_s
    # Export CPU over the learner CPU of the steps one row covers: the most it could take from a shared core.
    figures["tensorboard_cpu_fraction_256x3"] = (
        None if step is None else row_cpu_s * step["sgd_per_cpu_s"] / LOG_EVERY_STEPS)
    print(f"tensorboard export: {1e6 * row_cpu_s:.0f} us of CPU per learner.csv row (one row per {LOG_EVERY_STEPS} "
          f"SGD steps; {figures['tensorboard_cpu_fraction_256x3'] or float('nan'):.2e} of their CPU at D4PG 256x3)")
    machine = machine_info()
    machine.update(loadavg_before_1_5_15=load_before, threads=1, worker_core=worker_core(),
                   xla_flags={option: worker.xla_flags for option, worker in workers.items()})
    print_table(rows, machine)
    return report(args.json, "learner", machine, rows, figures,
                  "D4PG 256x3 under the learner's XLA flags; speedups vs the one-step call")


if __name__ == "__main__":
    sys.exit(main())
