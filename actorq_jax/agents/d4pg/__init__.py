"""D4PG: distributed distributional deterministic policy gradients with quantized actors."""

from actorq_jax.agents.d4pg.config import D4PGConfig
from actorq_jax.agents.registry import AgentEntry, register_agent

register_agent(AgentEntry(
    name="d4pg",
    config_class=D4PGConfig,
    actions="continuous",
    builder="actorq_jax.agents.d4pg.builder:D4PGBuilder",
    default_task="cartpole_balance",
    description="Runs D4PG with quantized actors: learner + Reverb, N actors and an evaluator.",
    # Small enough for 2 cores: tiny networks, a short warm-up, frequent publications and checkpoints.
    tiny=("--task", "cartpole_balance", "--policy_layers", "16,16", "--critic_layers", "32,32",
          "--batch_size", "16", "--min_replay_size", "100", "--samples_per_insert", "4",
          "--publish_period", "5", "--update_period", "50", "--eval_period", "50", "--checkpoint_period", "100"),
    quick=("--policy_layers", "16,16", "--critic_layers", "32,32", "--batch_size", "16", "--min_replay_size", "100"),
))

__all__ = ["D4PGConfig"]
