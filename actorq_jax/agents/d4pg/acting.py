"""D4PG policies as pure functions: Gaussian-noise behaviour policy and greedy evaluation policy."""

from typing import Sequence

import chex
import jax
import jax.numpy as jnp

from actorq_jax.agents.builder import GreedyPolicy, VectorPolicy
from actorq_jax.agents.d4pg.networks import D4PGNetworks


def make_vector_behaviour_policy(networks: D4PGNetworks, sigmas: Sequence[float]) -> VectorPolicy:
    """`(params, keys[K], observations[K]) -> actions[K]`: one batched policy call, row k's N(0, sigma_k^2) noise
    drawn from keys[k], clipped to the action bounds."""
    low = jnp.asarray(networks.policy.action_minimum, jnp.float32)
    high = jnp.asarray(networks.policy.action_maximum, jnp.float32)
    sigma = jnp.asarray(sigmas, jnp.float32)[:, None]

    def policy(params: chex.ArrayTree, keys: jax.Array, observations: jnp.ndarray) -> jnp.ndarray:
        actions = networks.policy.apply(params, observations)
        # Per-row keys: row k's noise does not depend on how many environments share the call.
        noise = jax.vmap(lambda key: jax.random.normal(key, actions.shape[1:], actions.dtype))(keys)
        return jnp.clip(actions + sigma * noise, low, high)

    return jax.jit(policy)


def make_greedy_policy(networks: D4PGNetworks) -> GreedyPolicy:
    """`(params, observation) -> action` without exploration noise."""

    def policy(params: chex.ArrayTree, observation: jnp.ndarray) -> jnp.ndarray:
        return networks.policy.apply(params, observation[None])[0]

    return jax.jit(policy)
