"""Assembles D4PG for the shared launcher: replay table, learner step, actor and evaluation policies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

import chex
import numpy as np

from actorq_jax.agents.builder import AgentBuilder, GreedyPolicy, LearningModule, Metrics, VectorPolicy, exploration_slots
from actorq_jax.agents.d4pg import acting, networks
from actorq_jax.agents.d4pg.config import D4PGConfig
from actorq_jax.environments import EnvironmentSpec
from actorq_jax.replay import ReplayBatch

if TYPE_CHECKING:
    from actorq_jax.agents.d4pg import learning


class D4PGBuilder(LearningModule, AgentBuilder):
    """D4PG behind the agent contract: uniform replay, a deterministic policy with Gaussian exploration."""

    learning_module = "actorq_jax.agents.d4pg.learning"

    def __init__(self, config: D4PGConfig, spec: EnvironmentSpec):
        if spec.discrete:
            raise ValueError("D4PG needs a continuous-action task; use DQN for discrete actions")
        self.config = config
        self.spec = spec
        self.networks = networks.make_networks(config, spec)
        self.actor_network = self.networks.policy

    def sgd_step(self, state: learning.TrainingState, batch: ReplayBatch) -> Tuple[learning.TrainingState, Metrics]:
        """One D4PG update of policy and critic."""
        return self._sgd_step(state, batch)

    def actor_params(self, state: learning.TrainingState) -> chex.ArrayTree:
        """The parameters actors and evaluators run: the online policy's."""
        return state.policy_params

    def vector_behaviour_policy(self, actor_id: int, num_actors: int, envs_per_actor: int) -> VectorPolicy:
        """Exploring policy of an actor's environments (each sigma from the per-actor spread over all of them)."""
        slots = exploration_slots(actor_id, num_actors, envs_per_actor)
        sigmas = [self.config.actor_sigma(slot, count) for slot, count in slots]
        return acting.make_vector_behaviour_policy(self.networks, sigmas)

    def greedy_policy(self) -> GreedyPolicy:
        """Noise-free policy for evaluation."""
        return acting.make_greedy_policy(self.networks)

    def example_action(self) -> np.ndarray:
        """An action with the replay table's dtype and shape."""
        return np.zeros((self.spec.action_dim,), np.float32)
