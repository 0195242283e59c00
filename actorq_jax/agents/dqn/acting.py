"""DQN policies as pure functions: epsilon-greedy behaviour policy and greedy evaluation policy."""

import chex
import jax
import jax.numpy as jnp

from actorq_jax.agents.builder import BehaviourPolicy, GreedyPolicy
from actorq_jax.agents.dqn.learning import DQNNetworks


def make_behaviour_policy(networks: DQNNetworks, epsilon: float) -> BehaviourPolicy:
    """`(params, key, observation) -> int32 action`: uniform with probability epsilon, else argmax Q."""
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")

    def policy(params: chex.ArrayTree, key: chex.PRNGKey, observation: jnp.ndarray) -> jnp.ndarray:
        q_values = networks.q.apply(params, observation[None])[0]
        explore_key, action_key = jax.random.split(key)
        random_action = jax.random.randint(action_key, (), 0, q_values.shape[-1], jnp.int32)
        # uniform() lies in [0, 1): epsilon 0 never explores, epsilon 1 always does.
        explore = jax.random.uniform(explore_key) < epsilon
        return jnp.where(explore, random_action, jnp.argmax(q_values).astype(jnp.int32))

    return jax.jit(policy)


def make_greedy_policy(networks: DQNNetworks) -> GreedyPolicy:
    """`(params, observation) -> int32 action` maximising Q."""

    def policy(params: chex.ArrayTree, observation: jnp.ndarray) -> jnp.ndarray:
        return jnp.argmax(networks.q.apply(params, observation[None])[0]).astype(jnp.int32)

    return jax.jit(policy)
