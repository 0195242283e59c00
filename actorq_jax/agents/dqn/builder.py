"""Assembles DQN for the shared launcher: prioritized replay table, learner step, actor and evaluation policies."""

import chex
import numpy as np

from actorq_jax.agents.builder import AgentBuilder
from actorq_jax.agents.dqn import acting, learning
from actorq_jax.agents.dqn.config import DQNConfig
from actorq_jax.environments import EnvironmentSpec


class DQNBuilder(AgentBuilder):
    """What the launcher needs from DQN (the same methods as D4PGBuilder)."""

    prioritized = True  # batches are ReplayBatch; the learner writes metrics["priorities"] back

    def __init__(self, config: DQNConfig, spec: EnvironmentSpec):
        if not spec.discrete:
            raise ValueError(
                f"DQN needs a discrete-action task; this task has {spec.action_dim} continuous action(s): use D4PG"
            )
        self.config = config
        self.spec = spec
        self.network = learning.make_network(config, spec)
        self.actor_network = self.network
        self.sgd_step = learning.make_sgd_step(config, self.network)

    def init_state(self, key: chex.PRNGKey) -> learning.TrainingState:
        """Fresh learner state."""
        return learning.init_state(self.config, self.network, self.spec, key)

    def actor_params(self, state: learning.TrainingState) -> chex.ArrayTree:
        """The parameters actors and evaluators run: the online Q-network's."""
        return state.params

    def behaviour_policy(self, actor_id: int, num_actors: int) -> acting.BehaviourPolicy:
        """Epsilon-greedy policy of one actor (its epsilon from the Ape-X spread)."""
        return acting.make_behaviour_policy(self.network, self.config.actor_epsilon(actor_id, num_actors))

    def greedy_policy(self) -> acting.GreedyPolicy:
        """Argmax-Q policy for evaluation."""
        return acting.make_greedy_policy(self.network)

    def example_action(self) -> np.ndarray:
        """An action with the replay table's dtype and shape: an int32 scalar."""
        return np.zeros((), np.int32)
