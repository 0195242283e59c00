"""Flax networks shared by the agents: MLPs, the D4PG policy and critic, the DQN Q-network."""

from actorq_jax.networks.layers import Dense, apply_dense
from actorq_jax.networks.modules import (
    MLP,
    CriticNetwork,
    PolicyNetwork,
    QNetwork,
    categorical_mean,
    value_atoms,
)

__all__ = [
    "Dense",
    "apply_dense",
    "MLP",
    "PolicyNetwork",
    "CriticNetwork",
    "QNetwork",
    "value_atoms",
    "categorical_mean",
]
