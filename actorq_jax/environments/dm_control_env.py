"""dm_control suite tasks as flat-observation, float32 dm_env environments."""

from __future__ import annotations

from typing import Optional

import dm_env
import numpy as np
from dm_env import specs

from actorq_jax.environments import _mujoco_gl  # noqa: F401  (sets MUJOCO_GL before dm_control loads)


class DmControlEnvironment(dm_env.Environment):
    """Wraps a dm_control environment: flat float32 observations, float32 rewards.

    Observations are the suite's observation dict concatenated in the suite's
    own key order (the order of `observation_spec()`, which every suite task
    fixes), each entry raveled (scalars become one element).

    `action_repeat` applies each action that many times, summing rewards and
    multiplying discounts, and stops early at the end of an episode.
    `max_episode_steps` (agent steps, i.e. after action repeat) ends an episode
    early as a truncation: a LAST step with discount 1.0. The suite's own time
    limit also ends episodes with discount 1.0.
    """

    def __init__(
        self,
        env: dm_env.Environment,
        action_repeat: int = 1,
        max_episode_steps: Optional[int] = None,
    ):
        if int(action_repeat) != action_repeat or action_repeat < 1:
            raise ValueError(f"action_repeat must be a positive integer, got {action_repeat!r}")
        if max_episode_steps is not None and (
            int(max_episode_steps) != max_episode_steps or max_episode_steps < 1
        ):
            raise ValueError(
                f"max_episode_steps must be a positive integer or None, got {max_episode_steps!r}"
            )
        self._env = env
        self._action_repeat = int(action_repeat)
        self._max_episode_steps = None if max_episode_steps is None else int(max_episode_steps)

        obs_spec = env.observation_spec()
        # Precomputed once: stepping is on the actor's hot path.
        self._keys = tuple(obs_spec.keys())
        dim = sum(int(np.prod(obs_spec[k].shape, dtype=np.int64)) for k in self._keys)
        self._observation_spec = specs.Array(shape=(dim,), dtype=np.float32, name="observation")

        action_spec = env.action_spec()
        self._action_spec = specs.BoundedArray(
            shape=action_spec.shape,
            dtype=np.float32,
            minimum=np.broadcast_to(action_spec.minimum, action_spec.shape).astype(np.float32),
            maximum=np.broadcast_to(action_spec.maximum, action_spec.shape).astype(np.float32),
            name="action",
        )
        self._episode_steps = 0
        self._reset_next_step = True

    def _flatten(self, observation) -> np.ndarray:
        return np.concatenate([np.ravel(observation[k]) for k in self._keys]).astype(
            np.float32, copy=False
        )

    def reset(self) -> dm_env.TimeStep:
        """Starts a new episode."""
        self._episode_steps = 0
        self._reset_next_step = False
        timestep = self._env.reset()
        return dm_env.TimeStep(dm_env.StepType.FIRST, None, None, self._flatten(timestep.observation))

    def step(self, action) -> dm_env.TimeStep:
        """Applies an action; after a LAST step, starts a new episode instead."""
        if self._reset_next_step:
            return self.reset()
        reward = 0.0
        discount = 1.0
        for _ in range(self._action_repeat):
            timestep = self._env.step(action)
            reward += timestep.reward
            discount *= timestep.discount
            if timestep.last():
                break
        self._episode_steps += 1
        step_type = timestep.step_type
        if (
            self._max_episode_steps is not None
            and self._episode_steps >= self._max_episode_steps
            and step_type != dm_env.StepType.LAST
        ):
            step_type = dm_env.StepType.LAST  # truncation: discount stays as the env gave it
        if step_type == dm_env.StepType.LAST:
            self._reset_next_step = True
        return dm_env.TimeStep(
            step_type, np.float32(reward), np.float32(discount), self._flatten(timestep.observation)
        )

    def observation_spec(self) -> specs.Array:
        """The flat float32 observation spec."""
        return self._observation_spec

    def action_spec(self) -> specs.BoundedArray:
        """The float32 bounded action spec."""
        return self._action_spec

    def close(self) -> None:
        """Releases the underlying simulator."""
        self._env.close()
