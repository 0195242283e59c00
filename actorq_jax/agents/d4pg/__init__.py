"""D4PG: distributed distributional deterministic policy gradients with quantized actors."""

from actorq_jax.agents.d4pg.config import D4PGConfig
from actorq_jax.agents.registry import AgentEntry, register_agent

register_agent(AgentEntry(
    name="d4pg",
    config_class=D4PGConfig,
    builder="actorq_jax.agents.d4pg.builder:D4PGBuilder",
    default_task="cartpole_balance",
    description="Runs D4PG with quantized actors: learner + Reverb, N actors and an evaluator.",
))

__all__ = ["D4PGConfig"]
