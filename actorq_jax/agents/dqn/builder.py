"""Assembles DQN for the shared launcher: prioritized replay table, learner step, actor and evaluation policies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Tuple

import chex
import numpy as np

from actorq_jax.agents.builder import (
    AgentBuilder,
    GreedyPolicy,
    LearningModule,
    Metrics,
    PriorityUpdate,
    VectorPolicy,
    exploration_slots,
)
from actorq_jax.agents.dqn import acting, networks
from actorq_jax.agents.dqn.config import DQNConfig
from actorq_jax.environments import EnvironmentSpec
from actorq_jax.replay import ReplayBatch

if TYPE_CHECKING:
    from actorq_jax.agents.dqn import learning


class DQNBuilder(LearningModule, AgentBuilder):
    """DQN behind the agent contract: prioritized replay, epsilon-greedy actors with the Ape-X spread."""

    learning_module = "actorq_jax.agents.dqn.learning"

    def __init__(self, config: DQNConfig, spec: EnvironmentSpec):
        if not spec.discrete:
            raise ValueError(
                f"DQN needs a discrete-action task; this task has {spec.action_dim} continuous action(s): use D4PG"
            )
        self.config = config
        self.spec = spec
        self.networks = networks.make_networks(config, spec)
        self.actor_network = self.networks.q

    @property
    def prioritized(self) -> bool:
        """DQN samples replay by priority (|TD error|)."""
        return True

    def sgd_step(self, state: learning.TrainingState, batch: ReplayBatch) -> Tuple[learning.TrainingState, Metrics]:
        """One importance-weighted double-Q update; metrics["priorities"] are the batch's |TD errors|."""
        return self._sgd_step(state, batch)

    def priority_update(self, batch: ReplayBatch, metrics: Metrics) -> Optional[PriorityUpdate]:
        """The sampled items' new priorities: their |TD errors|."""
        return PriorityUpdate(keys=np.asarray(batch.keys), priorities=np.asarray(metrics["priorities"]))

    def loggable_metrics(self, metrics: Metrics) -> Dict[str, float]:
        """The means of the step's metrics but the per-item priorities (written back, not logged)."""
        return super().loggable_metrics({k: v for k, v in metrics.items() if k != "priorities"})

    def actor_params(self, state: learning.TrainingState) -> chex.ArrayTree:
        """The parameters actors and evaluators run: the online Q-network's."""
        return state.params

    def vector_behaviour_policy(self, actor_id: int, num_actors: int, envs_per_actor: int) -> VectorPolicy:
        """Epsilon-greedy policy of an actor's environments (each epsilon from the Ape-X spread over all of them)."""
        slots = exploration_slots(actor_id, num_actors, envs_per_actor)
        epsilons = [self.config.actor_epsilon(slot, count) for slot, count in slots]
        return acting.make_vector_behaviour_policy(self.networks, epsilons)

    def greedy_policy(self) -> GreedyPolicy:
        """Argmax-Q policy for evaluation."""
        return acting.make_greedy_policy(self.networks)

    def example_action(self) -> np.ndarray:
        """An action with the replay table's dtype and shape: an int32 scalar."""
        return np.zeros((), np.int32)
