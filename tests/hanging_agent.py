"""A test agent: D4PG whose actors' policy call blocks, while a file names their process, inside the jitted call.

The block is a host callback that sleeps, so it releases the GIL as a stuck native call would: the actor's
other threads (its id lease's renewals among them) go on while its main loop is stuck. Runs load it by
naming MODULE in ACTORQ_AGENT_MODULES with tests/ on PYTHONPATH, and set HANG_FILE_ENV to the file.
"""

import os
import time
from typing import Any

import numpy as np

from actorq_jax.agents.d4pg.builder import D4PGBuilder
from actorq_jax.agents.d4pg.config import D4PGConfig
from actorq_jax.agents.registry import AgentEntry, get_agent, register_agent

NAME = "d4pg_hang"
MODULE = "hanging_agent"
HANG_FILE_ENV = "ACTORQ_TEST_HANG_FILE"


def _named_in_hang_file() -> bool:
    path = os.environ.get(HANG_FILE_ENV)
    try:
        return bool(path) and open(path).read().strip() == str(os.getpid())
    except FileNotFoundError:
        return False


def _hold_while_named() -> np.ndarray:
    while _named_in_hang_file():
        time.sleep(0.1)
    return np.zeros((), np.float32)


class HangingBuilder(D4PGBuilder):
    """D4PG; the exploring policy waits in a host callback while the hang file holds this process's pid."""

    def vector_behaviour_policy(self, actor_id: int, num_actors: int, envs_per_actor: int) -> Any:
        """D4PG's policy, gated by the hang file."""
        import jax
        import jax.numpy as jnp

        policy = super().vector_behaviour_policy(actor_id, num_actors, envs_per_actor)

        def gated(params: Any, keys: Any, observations: Any) -> Any:
            gate = jax.pure_callback(_hold_while_named, jax.ShapeDtypeStruct((), jnp.float32))
            return policy(params, keys, observations) + gate  # used, so the callback is not dropped

        return gated


ENTRY = register_agent(AgentEntry(
    name=NAME,
    config_class=D4PGConfig,
    builder=f"{MODULE}:HangingBuilder",
    actions="continuous",
    default_task="cartpole_balance",
    description="A test agent: D4PG whose actors hang on request.",
    tiny=get_agent("d4pg").tiny,
    quick=(),
))
