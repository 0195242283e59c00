"""D4PG policies as pure functions: Gaussian-noise behaviour policy and greedy evaluation policy."""

import chex
import jax
import jax.numpy as jnp

from actorq_jax.agents.builder import BehaviourPolicy, GreedyPolicy
from actorq_jax.agents.d4pg.learning import D4PGNetworks


def make_behaviour_policy(networks: D4PGNetworks, sigma: float) -> BehaviourPolicy:
    """`(params, key, observation) -> action`: policy + N(0, sigma^2) noise, clipped to the action bounds."""
    low = jnp.asarray(networks.policy.action_minimum, jnp.float32)
    high = jnp.asarray(networks.policy.action_maximum, jnp.float32)

    def policy(params: chex.ArrayTree, key: chex.PRNGKey, observation: jnp.ndarray) -> jnp.ndarray:
        action = networks.policy.apply(params, observation[None])[0]
        noise = sigma * jax.random.normal(key, action.shape, action.dtype)
        return jnp.clip(action + noise, low, high)

    return jax.jit(policy)


def make_greedy_policy(networks: D4PGNetworks) -> GreedyPolicy:
    """`(params, observation) -> action` without exploration noise."""

    def policy(params: chex.ArrayTree, observation: jnp.ndarray) -> jnp.ndarray:
        return networks.policy.apply(params, observation[None])[0]

    return jax.jit(policy)
