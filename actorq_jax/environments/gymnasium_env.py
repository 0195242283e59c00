"""gymnasium environments with discrete actions as dm_env environments."""

from __future__ import annotations

import dm_env
import gymnasium
import numpy as np
from dm_env import specs


class GymnasiumEnvironment(dm_env.Environment):
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
        if int(action_repeat) != action_repeat or action_repeat < 1:
            raise ValueError(f"action_repeat must be a positive integer, got {action_repeat!r}")
        self._env = env
        self._seed = int(seed)
        self._action_repeat = int(action_repeat)
        self._seeded = False
        self._reset_next_step = True
        # Discrete(n, start=s) maps our actions 0..n-1 onto s..s+n-1.
        self._action_start = int(env.action_space.start)
        dim = int(np.prod(env.observation_space.shape, dtype=np.int64))
        self._observation_spec = specs.Array(shape=(dim,), dtype=np.float32, name="observation")
        self._action_spec = specs.DiscreteArray(
            num_values=int(env.action_space.n), dtype=np.int32, name="action"
        )

    @staticmethod
    def _flatten(observation) -> np.ndarray:
        return np.asarray(observation, dtype=np.float32).ravel()

    def reset(self) -> dm_env.TimeStep:
        """Starts a new episode (seeded on the first call)."""
        if self._seeded:
            observation, _ = self._env.reset()
        else:
            observation, _ = self._env.reset(seed=self._seed)
            self._seeded = True
        self._reset_next_step = False
        return dm_env.TimeStep(dm_env.StepType.FIRST, None, None, self._flatten(observation))

    def step(self, action) -> dm_env.TimeStep:
        """Applies an integer action; after a LAST step, starts a new episode instead."""
        if self._reset_next_step:
            return self.reset()
        gym_action = int(action) + self._action_start
        reward = 0.0
        terminated = truncated = False
        for _ in range(self._action_repeat):
            observation, r, terminated, truncated, _ = self._env.step(gym_action)
            reward += r
            if terminated or truncated:
                break
        if terminated:
            self._reset_next_step = True
            return dm_env.TimeStep(
                dm_env.StepType.LAST, np.float32(reward), np.float32(0.0), self._flatten(observation)
            )
        step_type = dm_env.StepType.LAST if truncated else dm_env.StepType.MID
        self._reset_next_step = bool(truncated)
        return dm_env.TimeStep(step_type, np.float32(reward), np.float32(1.0), self._flatten(observation))

    def observation_spec(self) -> specs.Array:
        """The flat float32 observation spec."""
        return self._observation_spec

    def action_spec(self) -> specs.DiscreteArray:
        """The discrete action spec."""
        return self._action_spec

    def close(self) -> None:
        """Closes the gymnasium env."""
        self._env.close()
