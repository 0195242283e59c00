"""gymnasium environments with discrete actions as dm_env environments."""

from __future__ import annotations

import gymnasium
import numpy as np
from dm_env import specs

from actorq_jax.environments.base import FlatEnvironment


class GymnasiumEnvironment(FlatEnvironment):
    """Wraps a gymnasium env with a Box observation and a Discrete action space.

    Termination gives a LAST step with discount 0.0; truncation (e.g. by a
    gymnasium TimeLimit) gives a LAST step with discount 1.0, so bootstrapping
    continues through time limits. If both flags are set, termination wins.
    Observations are raveled to float32 vectors, rewards are float32 scalars,
    actions are integers in [0, num_actions).

    The first reset seeds the env with `seed`; later resets continue its
    random stream, so the same seed gives the same sequence of episodes.
    """

    def __init__(self, env: gymnasium.Env, seed: int, action_repeat: int = 1):
        if not isinstance(env.action_space, gymnasium.spaces.Discrete):
            raise ValueError(
                f"GymnasiumEnvironment needs a Discrete action space, got {env.action_space!r}"
            )
        if not isinstance(env.observation_space, gymnasium.spaces.Box):
            raise ValueError(
                f"GymnasiumEnvironment needs a Box observation space, got {env.observation_space!r}"
            )
        # Episode limits come from gymnasium's TimeLimit (see make_environment), not from the base class.
        super().__init__(env, action_repeat)
        self._seed = int(seed)
        self._seeded = False
        # Discrete(n, start=s) maps our actions 0..n-1 onto s..s+n-1.
        self._action_start = int(env.action_space.start)
        dim = int(np.prod(env.observation_space.shape, dtype=np.int64))
        self._observation_spec = specs.Array(shape=(dim,), dtype=np.float32, name="observation")
        self._action_spec = specs.DiscreteArray(
            num_values=int(env.action_space.n), dtype=np.int32, name="action"
        )

    def _flatten(self, observation) -> np.ndarray:
        return np.asarray(observation, dtype=np.float32).ravel()

    def _reset_env(self):
        # Seeded once: later resets continue the env's random stream.
        observation, _ = self._env.reset() if self._seeded else self._env.reset(seed=self._seed)
        self._seeded = True
        return observation

    def _step_env(self, action) -> tuple:
        observation, reward, terminated, truncated, _ = self._env.step(int(action) + self._action_start)
        return reward, 0.0 if terminated else 1.0, observation, bool(terminated or truncated)
