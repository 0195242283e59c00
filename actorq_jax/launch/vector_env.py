"""An actor's K environments, stepped in lockstep under one batched policy call.

Environment k of an actor has its own seed and its own exploration key stream:
its steps are those a one-environment actor with that seed, in the same
exploration slot (agents.builder.exploration_slots), would take. So K
environments in one process write the transitions K one-environment actors
would, and one environment is exactly today's one-environment actor.
"""

from typing import Any, Callable, List, NamedTuple, Sequence

import numpy as np

from actorq_jax.launch import runtime


def env_seeds(run_seed: int, actor_id: int, restart: int, envs_per_actor: int) -> List[int]:
    """The seed of each environment of an actor (one environment keeps the one-environment actor's seed)."""
    if envs_per_actor < 1:
        raise ValueError(f"envs_per_actor must be >= 1, got {envs_per_actor}")
    if envs_per_actor == 1:
        return [runtime.derive_seed(run_seed, actor_id, restart)]
    return [runtime.derive_seed(run_seed, actor_id, restart, k) for k in range(envs_per_actor)]


def make_vector_act(policy: Callable[[Any, Any, Any], Any]) -> Callable[[Any, Any, int, np.ndarray], Any]:
    """`(params, keys[K], step, observations[K]) -> actions[K]`, jitted: row k acts with fold_in(keys[k], step)."""
    import jax

    fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))

    @jax.jit
    def act(params: Any, keys: jax.Array, step: jax.Array, observations: jax.Array) -> jax.Array:
        # Folding the step in inside jit keeps key handling off the per-step Python path.
        return policy(params, fold(keys, step), observations)

    return act


class Finished(NamedTuple):
    """An episode one environment finished."""

    env_index: int
    episode_return: float
    episode_length: int


class VectorEnv:
    """K seeded environments with their current timesteps, returns and lengths."""

    def __init__(self, task: str, seeds: Sequence[int]):
        import jax
        import jax.numpy as jnp

        from actorq_jax.environments import make_environment

        if not seeds:
            raise ValueError("a VectorEnv needs at least one seed")
        self.seeds = [int(s) for s in seeds]
        self.envs = [make_environment(task, seed=s) for s in self.seeds]
        # Env k's exploration keys: the stream a one-environment actor seeded seeds[k] draws from.
        self.keys = jnp.stack([jax.random.PRNGKey(s) for s in self.seeds])
        self.timesteps: List[Any] = [None] * len(self.envs)
        self.returns = [0.0] * len(self.envs)
        self.lengths = [0] * len(self.envs)

    def __len__(self) -> int:
        return len(self.envs)

    def reset(self, k: int) -> Any:
        """Starts a new episode in environment k; its FIRST timestep."""
        self.timesteps[k] = self.envs[k].reset()
        self.returns[k], self.lengths[k] = 0.0, 0
        return self.timesteps[k]

    def observations(self) -> np.ndarray:
        """The current observation of every environment, stacked [K, obs]."""
        return np.stack([t.observation for t in self.timesteps])

    def step(self, actions: np.ndarray) -> List[Any]:
        """Steps environment k with actions[k]; the new timesteps."""
        for k, env in enumerate(self.envs):
            timestep = env.step(actions[k])
            self.timesteps[k] = timestep
            self.returns[k] += float(timestep.reward)
            self.lengths[k] += 1
        return self.timesteps

    def finished(self) -> List[Finished]:
        """The environments whose episode just ended (reset them before the next step)."""
        return [Finished(k, self.returns[k], self.lengths[k]) for k, t in enumerate(self.timesteps) if t.last()]
