"""D4PG: distributed distributional deterministic policy gradients with quantized actors."""

from actorq_jax.agents.d4pg.config import D4PGConfig

__all__ = ["D4PGConfig"]
