"""DQN policies as pure functions: epsilon-greedy behaviour policy and greedy evaluation policy."""

from typing import Sequence

import chex
import jax
import jax.numpy as jnp

from actorq_jax.agents.builder import GreedyPolicy, VectorPolicy
from actorq_jax.agents.dqn.networks import DQNNetworks


def make_vector_behaviour_policy(networks: DQNNetworks, epsilons: Sequence[float]) -> VectorPolicy:
    """`(params, keys[K], observations[K]) -> int32 actions[K]`: row k is uniform with probability epsilon_k
    (drawn from keys[k]), else argmax Q; one batched network call."""
    bad = [e for e in epsilons if not 0.0 <= e <= 1.0]
    if bad or not len(epsilons):
        raise ValueError(f"epsilon must be in [0, 1], got {list(epsilons)}")
    epsilon = jnp.asarray(epsilons, jnp.float32)

    def policy(params: chex.ArrayTree, keys: jax.Array, observations: jnp.ndarray) -> jnp.ndarray:
        q_values = networks.q.apply(params, observations)
        num_actions = q_values.shape[-1]

        def explore(key: jax.Array, eps: jnp.ndarray, greedy: jnp.ndarray) -> jnp.ndarray:
            explore_key, action_key = jax.random.split(key)
            random_action = jax.random.randint(action_key, (), 0, num_actions, jnp.int32)
            # uniform() lies in [0, 1): epsilon 0 never explores, epsilon 1 always does.
            return jnp.where(jax.random.uniform(explore_key) < eps, random_action, greedy)

        return jax.vmap(explore)(keys, epsilon, jnp.argmax(q_values, axis=-1).astype(jnp.int32))

    return jax.jit(policy)


def make_greedy_policy(networks: DQNNetworks) -> GreedyPolicy:
    """`(params, observation) -> int32 action` maximising Q."""

    def policy(params: chex.ArrayTree, observation: jnp.ndarray) -> jnp.ndarray:
        return jnp.argmax(networks.q.apply(params, observation[None])[0]).astype(jnp.int32)

    return jax.jit(policy)
