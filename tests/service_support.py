"""An in-process replay service, learner and actor for tests of the learner's replay path (real Reverb server)."""

import contextlib
import threading
from typing import Any, Iterator, Tuple


@contextlib.contextmanager
def dqn_service_learner_actor(results_dir: Any, rate_limiter: str = "min_size",
                              **run_fields: Any) -> Iterator[Tuple[Any, Any, Any]]:
    """(service, learner, connected actor) of a tiny prioritized DQN on CartPole, closed afterwards.

    No insert/sample ratio by default: the actor here writes while the learner waits, and the reverse.
    """
    from actorq_jax.agents.dqn.config import DQNConfig
    from actorq_jax.environments import environment_spec, make_environment
    from actorq_jax.launch import runtime
    from actorq_jax.launch.actor import Actor
    from actorq_jax.launch.config import RunConfig
    from actorq_jax.launch.learner import Learner
    from actorq_jax.launch.replay_service import ReplayService

    run = RunConfig(agent="dqn", task="CartPole-v1", results_dir=str(results_dir), num_actors=1, **run_fields)
    sampling = {"max_times_sampled": 1000} if rate_limiter == "min_size" else {}  # the ratio bounds it itself
    agent = DQNConfig(q_layers=(16, 16), batch_size=16, min_replay_size=50, rate_limiter=rate_limiter, **sampling)
    builder = runtime.make_builder("dqn", agent, environment_spec(make_environment("CartPole-v1", seed=0)))
    service = ReplayService(builder, run, results_dir, "{}", resume=False)
    address = f"127.0.0.1:{service.server.port}"
    learner = Learner(builder, run, results_dir, address)
    actor = None
    try:
        learner.publish()
        assert learner.publisher.flush(timeout_s=60)
        actor = Actor(run, agent, 0, address, threading.Event())
        assert actor.connect()
        yield service, learner, actor
    finally:
        if actor is not None:
            actor.close()
        learner.publisher.close()
        learner.checkpointer.close()
        service.stop()
