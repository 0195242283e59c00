"""D4PG's networks: what actors, the evaluator and the learner all build (no loss code, so actors skip rlax)."""

from typing import NamedTuple

import jax.numpy as jnp

from actorq_jax.agents.d4pg.config import D4PGConfig
from actorq_jax.environments import EnvironmentSpec
from actorq_jax.networks import CriticNetwork, PolicyNetwork, value_atoms


class D4PGNetworks(NamedTuple):
    """The policy and critic modules plus the critic's value atoms."""

    policy: PolicyNetwork
    critic: CriticNetwork
    atoms: jnp.ndarray


def make_networks(config: D4PGConfig, spec: EnvironmentSpec) -> D4PGNetworks:
    """Builds the D4PG policy (squashed to the action bounds) and distributional critic."""
    policy = PolicyNetwork(
        action_dim=spec.action_dim,
        layer_sizes=tuple(config.policy_layers),
        layer_norm=config.policy_layer_norm,
        activation="elu" if config.policy_layer_norm else "relu",
        action_minimum=tuple(float(v) for v in spec.action_minimum),
        action_maximum=tuple(float(v) for v in spec.action_maximum),
    )
    critic = CriticNetwork(layer_sizes=tuple(config.critic_layers), num_atoms=config.num_atoms)
    return D4PGNetworks(policy, critic, value_atoms(config.v_min, config.v_max, config.num_atoms))
