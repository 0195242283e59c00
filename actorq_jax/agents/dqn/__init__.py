"""DQN: double Q-learning on n-step returns from prioritized replay, with quantized epsilon-greedy actors."""

from actorq_jax.agents.dqn.config import DQNConfig

__all__ = ["DQNConfig"]
