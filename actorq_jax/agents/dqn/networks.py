"""DQN's Q-network: what actors, the evaluator and the learner all build (no loss code, so actors skip rlax)."""

from typing import NamedTuple

from actorq_jax.agents.dqn.config import DQNConfig
from actorq_jax.environments import EnvironmentSpec
from actorq_jax.networks import QNetwork


class DQNNetworks(NamedTuple):
    """The Q-network (the module actors run)."""

    q: QNetwork


def make_networks(config: DQNConfig, spec: EnvironmentSpec) -> DQNNetworks:
    """The Q-network: observation -> one value per discrete action."""
    if not spec.discrete:
        raise ValueError("DQN needs a discrete-action task (e.g. CartPole-v1); use D4PG for continuous actions")
    return DQNNetworks(q=QNetwork(num_actions=int(spec.num_actions), layer_sizes=tuple(config.q_layers)))
