"""actorq-jax: quantized distributed reinforcement learning (ActorQ) in JAX."""

__version__ = "0.1.0"
