"""The evaluator process: greedy episodes of the float policy and of the actors' quantized policy."""

import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

from actorq_jax.launch import runtime


def run_episode(env: Any, policy: Callable[[Any, Any], Any], params: Any) -> float:
    """Return of one greedy episode."""
    import numpy as np

    timestep = env.reset()
    total = 0.0
    while not timestep.last():
        timestep = env.step(np.asarray(policy(params, timestep.observation)))
        total += float(timestep.reward)
    return total


def actors_view(run: Any) -> Callable[[Any], Any]:
    """`float payload -> what the actors run`: the payload they receive (comm_bits), through their own loader."""
    from actorq_jax.launch.precision import ActorPrecision, make_param_loader
    from actorq_jax.quantization import QuantConfig, dequantize, quantize

    precision = ActorPrecision(run.actor_bits, run.wire_bits, run.granularity, run.actor_backend, run.int8_mode)
    load = make_param_loader(precision)
    wire = QuantConfig(bits=run.wire_bits, granularity=run.granularity)
    # The learner's publisher quantizes the same float weights at the same config, and the wire is lossless.
    return lambda float_payload: load(quantize(dequantize(float_payload), wire))


def run_evaluator(run: Any, agent_config: Any, address: str, stop: threading.Event,
                  launcher_alive: Callable[[], bool] = lambda: True) -> None:
    """Evaluates every new float policy the learner publishes, and once more at shutdown."""
    from actorq_jax.environments import environment_spec, make_environment
    from actorq_jax.quantization import QuantConfig, dequantize, quantize
    from actorq_jax.replay import VariableClient, wait_for_server
    from actorq_jax.telemetry import EVAL_FIELDS, CsvLogger

    results_dir = Path(run.results_dir)
    env = make_environment(run.task, seed=runtime.derive_seed(run.seed, 10_000))
    spec = environment_spec(env)
    builder = runtime.make_builder(run.agent, agent_config, spec)
    greedy = builder.greedy_policy()
    like = builder.params_template()
    policies = [("fp32", 32, dequantize)]
    if run.actor_bits != 32:
        policies.append(("actor", run.actor_bits, actors_view(run)))
    wait_for_server(address, timeout_s=60.0)
    # Refreshed by hand (update_period is irrelevant): the evaluator polls for new versions. A learner that
    # restarts is away for a moment: keep the last policy and go on rather than fail (errors are logged).
    variables = VariableClient(address, runtime.EVAL_VARIABLES_TABLE, update_period=1,
                               like=quantize(like, QuantConfig(bits=32)), raise_errors=False)
    # Wall time counts from the launcher's start, so eval.csv lines up with every other stream.
    start = float(runtime.read_status(results_dir, "launcher").get("start_time", time.time()))
    last_version: Optional[int] = None

    def fetch() -> Optional[Tuple[Any, int]]:
        variables.refresh(timeout_s=60.0)
        return None if variables.params is None else (variables.params, variables.version)

    with CsvLogger(results_dir / "eval.csv", EVAL_FIELDS) as logger:
        while True:
            final = stop.is_set()
            if final:
                # Wait for the learner's last publication before the final evaluation (a launcher that
                # is gone will release no learner: evaluate what there is).
                deadline = time.monotonic() + 60
                while runtime.read_status(results_dir, "learner").get("phase") not in ("final", "done"):
                    if time.monotonic() > deadline or not launcher_alive():
                        break
                    time.sleep(0.2)
            fetched = fetch()
            if fetched is not None and (fetched[1] != last_version or final):
                qparams, version = fetched
                env_steps = runtime.read_status(results_dir, "learner").get("env_steps", 0)
                for name, bits, load in policies:
                    params = load(qparams)
                    for episode in range(run.eval_episodes):
                        logger.write({
                            "wall_seconds": round(time.time() - start, 3),
                            "env_steps": env_steps,
                            "learner_steps": version,
                            "policy": name,
                            "bits": bits,
                            "episode": episode,
                            "return": run_episode(env, greedy, params),
                            "final": int(final),
                        })
                logger.flush()
                last_version = version
            if final:
                variables.stop()
                return
            stop.wait(0.5)
