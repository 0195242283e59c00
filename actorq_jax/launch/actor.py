"""The actor process: runs a quantized policy in an environment and writes n-step transitions to replay.

Remote actors join a running learner from another machine:

    python -m actorq_jax.launch.actor --server HOST:PORT --actor_id 7 --log_dir ./remote_logs

The configuration (task, agent, bits...) is read from the learner's server, so a
remote actor always runs the same experiment as the local ones.
"""

import argparse
import dataclasses
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from actorq_jax.launch import runtime

log = logging.getLogger(__name__)

ACTOR_FIELDS = (
    "actor_id", "episode", "env_steps", "episode_return", "episode_length", "wall_seconds",
    "params_version", "env_step_s", "inference_s", "adder_s", "pull_s", "deserialize_s", "load_s",
)
FIRST_VARIABLES_TIMEOUT_S = 120.0


def run_actor(
    run: Any,
    agent_config: Any,
    actor_id: int,
    address: str,
    stop: threading.Event,
    log_dir: Path,
    restart: int = 0,
    max_episodes: Optional[int] = None,
) -> None:
    """Actor main loop: act, write transitions, refresh variables in the background, log each episode."""
    import jax
    import numpy as np

    from actorq_jax.environments import environment_spec, make_environment
    from actorq_jax.launch.precision import ActorPrecision, make_param_loader, resolve_backend
    from actorq_jax.quantization import QuantConfig, quantize
    from actorq_jax.replay import NStepAdder, VariableClient, wait_for_server
    from actorq_jax.telemetry import CsvLogger, PhaseTimer

    seed = runtime.derive_seed(run.seed, actor_id, restart)
    env = make_environment(run.task, seed=seed)
    spec = environment_spec(env)
    builder = runtime.make_builder(run.agent, agent_config, spec)
    policy = builder.behaviour_policy(actor_id, run.num_actors)

    @jax.jit
    def act(params: Any, key: jax.Array, step: jax.Array, observation: jax.Array) -> jax.Array:
        # Folding the step in inside jit keeps key handling off the per-step Python path.
        return policy(params, jax.random.fold_in(key, step), observation)

    precision = ActorPrecision(run.actor_bits, run.wire_bits, run.granularity, run.actor_backend, run.int8_mode)
    if resolve_backend(precision) == "int8":
        from actorq_jax import kernels

        kernels.set_num_threads(max(1, run.actor_threads))
        log.info("%s", kernels.describe_kernel())
    like = quantize(builder.params_template(), QuantConfig(bits=run.wire_bits, granularity=run.granularity))
    client = wait_for_server(address, timeout_s=60.0)
    variables = VariableClient(
        address, runtime.VARIABLES_TABLE, update_period=run.update_period, like=like, load_fn=make_param_loader(precision)
    )
    adder_config = builder.adder_config()
    adder = NStepAdder(client, adder_config.table, adder_config.n_step, adder_config.discount)
    key = jax.random.PRNGKey(seed)
    timer = PhaseTimer()
    # One row per episode, flushed at once: a killed actor loses no finished episode.
    logger = CsvLogger(Path(log_dir) / f"actor_{actor_id}.csv", ACTOR_FIELDS, flush_every_s=0)
    start = time.monotonic()
    total_steps, episode, timings_seen = 0, 0, 0
    try:
        variables.wait_for_first(FIRST_VARIABLES_TIMEOUT_S)
        while not stop.is_set() and (max_episodes is None or episode < max_episodes):
            timestep = env.reset()
            adder.add_first(timestep)
            episode_return, length = 0.0, 0
            while not timestep.last() and not stop.is_set():
                with timer.phase("inference"):
                    action = np.asarray(act(variables.params, key, total_steps, timestep.observation))
                with timer.phase("env_step"):
                    timestep = env.step(action)
                with timer.phase("adder"):
                    adder.add(action, timestep)
                variables.update()
                episode_return += float(timestep.reward)
                length += 1
                total_steps += 1
            if not timestep.last():
                break  # stopped mid-episode: the partial episode is not logged as a return
            episode += 1
            timings = variables.timings
            for t in timings[timings_seen:]:
                timer.add("pull", t.pull_s)
                timer.add("deserialize", t.deserialize_s)
                timer.add("load", t.load_s)
            timings_seen = len(timings)
            totals = timer.totals()
            logger.write({
                "actor_id": actor_id,
                "episode": episode,
                "env_steps": total_steps,
                "episode_return": episode_return,
                "episode_length": length,
                "wall_seconds": round(time.monotonic() - start, 3),
                "params_version": variables.version,
                **{f"{name}_s": round(totals.get(name, 0.0), 6)
                   for name in ("env_step", "inference", "adder", "pull", "deserialize", "load")},
            })
            timer.reset()
    finally:
        variables.stop()
        adder.close()
        logger.close()


def _fetch_config(address: str) -> str:
    """config.json text published by the learner on its server."""
    from actorq_jax.replay import wait_for_server

    client = wait_for_server(address, timeout_s=60.0)
    sample = next(client.sample(runtime.CONFIG_TABLE, num_samples=1, emit_timesteps=False))
    return bytes(sample.data[0].astype("uint8")).decode()


def main(argv: Optional[list] = None) -> int:
    """Entry point of a (possibly remote) actor joining a running learner."""
    parser = argparse.ArgumentParser(description="Join a running ActorQ learner as one more actor.")
    parser.add_argument("--server", required=True, help="learner's Reverb address HOST:PORT (printed by the launcher)")
    parser.add_argument("--actor_id", type=int, default=100, help="id used in logs and for seeding (default 100)")
    parser.add_argument("--log_dir", default="remote_actor_logs", help="where this actor writes actor_<id>.csv")
    parser.add_argument("--threads", type=int, default=1, help="XLA/intra-op threads of this actor (default 1)")
    parser.add_argument("--max_episodes", type=int, default=None, help="stop after this many episodes")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.max_episodes is not None and args.max_episodes < 1:
        parser.error(f"--max_episodes must be >= 1, got {args.max_episodes}")
    try:
        from actorq_jax.replay.server import parse_address

        parse_address(args.server)
    except ValueError as error:
        parser.error(f"--server: {error}")
    runtime.apply_thread_env(args.threads)
    stop = runtime.install_stop_handlers()
    from actorq_jax.launch.config import config_from_json

    try:
        run, agent_config = config_from_json(_fetch_config(args.server))
        run = dataclasses.replace(run, actor_threads=args.threads)  # this machine's budget, not the learner's
    except TimeoutError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    run_actor(run, agent_config, args.actor_id, args.server, stop, Path(args.log_dir), max_episodes=args.max_episodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
