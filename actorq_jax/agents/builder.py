"""What every agent's builder shares: its replay table and the template of the parameters actors run."""

from typing import Any

import chex
import jax
import jax.numpy as jnp

from actorq_jax.replay import ReplayTableConfig


class AgentBuilder:
    """Base of D4PGBuilder and DQNBuilder; subclasses set `config`, `spec` and `actor_network`."""

    prioritized = False  # True: batches are ReplayBatch and the learner writes priorities back
    config: Any  # has max_replay_size, min_replay_size, samples_per_insert (and priority_exponent if prioritized)
    spec: Any
    actor_network: Any  # the flax module actors and evaluators run

    def replay_config(self) -> ReplayTableConfig:
        """Replay with FIFO removal, rate-limited to the configured samples per insert; prioritized if the agent is."""
        c = self.config
        return ReplayTableConfig(
            name="replay",
            max_size=c.max_replay_size,
            min_size=c.min_replay_size,
            samples_per_insert=c.samples_per_insert,
            prioritized=self.prioritized,
            **({"priority_exponent": c.priority_exponent} if self.prioritized else {}),
        )

    def params_template(self) -> chex.ArrayTree:
        """Float actor parameters of the right structure (for checking incoming payloads)."""
        obs = jnp.zeros((1, self.spec.observation_dim), jnp.float32)
        return self.actor_network.init(jax.random.PRNGKey(0), obs)
