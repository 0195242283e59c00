"""DQN: double Q-learning on n-step returns from prioritized replay, with quantized epsilon-greedy actors."""

from actorq_jax.agents.dqn.config import DQNConfig
from actorq_jax.agents.registry import AgentEntry, register_agent

register_agent(AgentEntry(
    name="dqn",
    config_class=DQNConfig,
    actions="discrete",
    builder="actorq_jax.agents.dqn.builder:DQNBuilder",
    default_task="CartPole-v1",
    description="Runs DQN with quantized actors: learner + prioritized Reverb replay, N actors and an evaluator.",
    # CartPole with a tiny Q-network and a short warm-up.
    tiny=("--task", "CartPole-v1", "--q_layers", "16,16", "--batch_size", "16", "--min_replay_size", "100"),
    quick=("--q_layers", "16,16", "--batch_size", "16", "--min_replay_size", "100"),
))

__all__ = ["DQNConfig"]
