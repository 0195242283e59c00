"""dm_control suite tasks as flat-observation, float32 dm_env environments."""

from __future__ import annotations

from typing import Optional

import dm_env
import numpy as np
from dm_env import specs

from actorq_jax.environments import _mujoco_gl  # noqa: F401  (sets MUJOCO_GL before dm_control loads)
from actorq_jax.environments.base import FlatEnvironment


class DmControlEnvironment(FlatEnvironment):
    """Wraps a dm_control environment: flat float32 observations, float32 rewards.

    Observations are the suite's observation dict concatenated in the suite's
    own key order (the order of `observation_spec()`, which every suite task
    fixes), each entry raveled (scalars become one element).

    `action_repeat` and `max_episode_steps` work as in FlatEnvironment. The
    suite's own time limit also ends episodes with discount 1.0.
    """

    def __init__(
        self,
        env: dm_env.Environment,
        action_repeat: int = 1,
        max_episode_steps: Optional[int] = None,
    ):
        super().__init__(env, action_repeat, max_episode_steps)
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

    def _flatten(self, observation) -> np.ndarray:
        return np.concatenate([np.ravel(observation[k]) for k in self._keys]).astype(
            np.float32, copy=False
        )

    def _reset_env(self):
        return self._env.reset().observation

    def _step_env(self, action) -> tuple:
        timestep = self._env.step(action)
        return timestep.reward, timestep.discount, timestep.observation, timestep.last()
