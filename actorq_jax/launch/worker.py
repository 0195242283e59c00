"""Entry point of the processes the launcher starts: `python -m actorq_jax.launch.worker ROLE ...`.

Thread budgets are environment variables that XLA and TensorFlow read once, so
this module sets them before anything imports JAX.

A worker never outlives its launcher: Linux SIGTERMs it when the launcher dies
(runtime.die_with_parent), and once the launcher is gone nothing waits for it
(the learner still writes its final checkpoint; everyone exits within seconds).
"""

import argparse
import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

from actorq_jax.launch import runtime
from actorq_jax.run_dir import RunDir

# How long a worker whose launcher is gone may still take to finish (the evaluator's final
# evaluation otherwise gets 600 s).
ORPHAN_GRACE_S = 10.0
ROLES = ("replay", "learner", "actor", "evaluator")


def main(argv: Optional[list] = None) -> int:
    """Runs one replay service, learner, actor or evaluator of the run in --results_dir."""
    parser = argparse.ArgumentParser(description="One worker process of an ActorQ run (started by the launcher).")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--results_dir", required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--actor_id", type=int, default=0)
    parser.add_argument("--restart", type=int, default=0,
                        help="restarts of this slot (a learner or replay service restarts from its checkpoint)")
    parser.add_argument("--server", default=None)
    parser.add_argument("--port", type=int, default=None,
                        help="the replay service's port (the launcher's current pick; under Ray a host keeps the "
                             "config.json it started with)")
    parser.add_argument("--parent_pid", type=int, default=0, help="the launcher's pid (0: whoever started us)")
    args = parser.parse_args(argv)
    runtime.apply_thread_env(args.threads)
    if args.role == "learner":
        from actorq_jax.agents.learner_xla import learner_xla_flags

        # The XLA:CPU runtime benchmarks/learner.py measures faster for the SGD step (read at backend start).
        os.environ["XLA_FLAGS"] = learner_xla_flags(os.environ.get("XLA_FLAGS", ""))
    runtime.die_with_parent()
    parent = args.parent_pid or os.getppid()
    if os.getppid() != parent:  # the launcher died before the death signal was armed
        print(f"{args.role}: launcher {parent} is gone; exiting", file=sys.stderr)
        return 1
    launcher_alive = lambda: os.getppid() == parent  # noqa: E731 (orphans are re-parented)
    stop = runtime.install_stop_handlers()
    # force: in a worker forked from the template (launch/forker.py), absl's import already put a handler there.
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.role}: %(message)s", force=True)
    # Orbax logs about 40 INFO lines per checkpoint (through absl) and JAX one per accelerator it does not find:
    # their warnings stay, their chatter goes, so a worker's log reads as the run's own events.
    for chatty in ("absl", "jax._src.xla_bridge"):
        logging.getLogger(chatty).setLevel(logging.WARNING)

    from actorq_jax.launch.config import config_from_json

    results_dir = RunDir(args.results_dir)
    config_json = results_dir.config.read_text()
    run, agent_config = config_from_json(config_json)
    try:
        runtime.apply_cpu_affinity(args.role, run)
    except ValueError as error:
        logging.error("%s", error)  # cores this machine lacks: the run's own input, said without a traceback
        return 2
    runtime.apply_jax_platform(args.role, run)
    if args.role == "replay" and args.port is not None:
        run = dataclasses.replace(run, port=args.port)
    if args.restart and args.role in ("replay", "learner"):
        run = dataclasses.replace(run, resume=True)  # a restarted learner or service continues from its checkpoint
    if args.role == "replay":
        from actorq_jax.launch.replay_service import run_replay_service
        from actorq_jax.net import PortTaken
        from actorq_jax.replay.server import CheckpointMismatch

        # The service loop only polls and answers: run it on the main thread.
        try:
            run_replay_service(run, agent_config, config_json, stop, launcher_alive=launcher_alive)
        except CheckpointMismatch as error:
            logging.error("%s", error)  # the run's own input, not a fault: its message, without a traceback
            return 2
        except PortTaken as error:
            logging.error("%s", error)
            return runtime.EXIT_PORT_TAKEN
        return 0
    if args.role == "learner":
        from actorq_jax.launch.learner import run_learner

        # The learner never blocks for long (every service call is bounded): run it on the main thread.
        return run_learner(run, agent_config, args.server, stop)
    if args.role == "actor":
        from actorq_jax.launch.actor import WRITE_TIMEOUT_S, run_actor
        from actorq_jax.launch.actor_rows import RowForwarder

        # Under Ray the rows reach the launcher's results directory through the replay service, each once.
        forwarder = RowForwarder(args.server, WRITE_TIMEOUT_S) if run.launcher == "ray" else None
        target = lambda: run_actor(  # noqa: E731
            run, agent_config, args.actor_id, args.server, stop, results_dir.actors, restart=args.restart,
            forwarder=forwarder, takeover_id=True)
    else:
        from actorq_jax.launch.evaluator import run_evaluator

        target = lambda: run_evaluator(run, agent_config, args.server, stop, launcher_alive)  # noqa: E731
    # The evaluator's final evaluation runs after the stop request: give it time.
    return run_until_stopped(target, stop, grace_s=10.0 if args.role == "actor" else 600.0,
                             launcher_alive=launcher_alive)


def run_until_stopped(target: Callable[[], Optional[int]], stop: threading.Event, grace_s: float = 10.0,
                      launcher_alive: Callable[[], bool] = lambda: True) -> int:
    """Runs `target` in a thread; once `stop` is set, gives it `grace_s` to finish, then exits anyway.

    Without a launcher the grace is at most ORPHAN_GRACE_S: nobody waits for the result.

    An actor can sit inside a Reverb call that the rate limiter holds (the learner
    has stopped sampling), where Python signal handlers cannot reach it. Its logs
    are flushed row by row, so leaving without unwinding it loses nothing.
    """
    errors: list = []
    codes: list = []

    def body() -> None:
        try:
            codes.append(target())
        except BaseException as error:  # reported by the main thread below, with its traceback
            errors.append(error)
            logging.exception("worker failed")

    thread = threading.Thread(target=body, name="worker", daemon=True)
    thread.start()
    while thread.is_alive() and not stop.is_set():
        thread.join(0.5)
    deadline = time.monotonic() + grace_s
    while thread.is_alive() and time.monotonic() < deadline:
        if not launcher_alive():
            deadline = min(deadline, time.monotonic() + ORPHAN_GRACE_S)
        thread.join(0.5)
    if thread.is_alive():
        logging.warning("still blocked %.0f s after the stop request (likely a rate-limited Reverb call); exiting", grace_s)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 1 if errors else int(codes[0] or 0) if codes else 0


if __name__ == "__main__":
    sys.exit(main())
