"""What the dm_control and gymnasium wrappers share: episode bookkeeping, action repeat, flat float32 time steps."""

from __future__ import annotations

import abc
from typing import Any, Optional, Tuple

import dm_env
import numpy as np
from dm_env import specs


def _is_positive_int(value: Any) -> bool:
    return int(value) == value and value >= 1


class FlatEnvironment(dm_env.Environment, abc.ABC):
    """A dm_env view of a simulator: flat float32 observations, float32 rewards and discounts.

    `action_repeat` applies each action that many times, summing rewards and
    multiplying discounts, and stops early at the end of an episode.
    `max_episode_steps` (agent steps, i.e. after action repeat) ends an episode
    early as a truncation: a LAST step whose discount is the simulator's (1.0
    unless it also terminated). Stepping after a LAST step starts a new episode.

    Subclasses set `_observation_spec` and `_action_spec` and say how to reset,
    step and flatten the wrapped simulator.
    """

    _observation_spec: specs.Array
    _action_spec: specs.Array

    def __init__(self, env: Any, action_repeat: int = 1, max_episode_steps: Optional[int] = None):
        if not _is_positive_int(action_repeat):
            raise ValueError(f"action_repeat must be a positive integer, got {action_repeat!r}")
        if max_episode_steps is not None and not _is_positive_int(max_episode_steps):
            raise ValueError(f"max_episode_steps must be a positive integer or None, got {max_episode_steps!r}")
        self._env = env
        self._action_repeat = int(action_repeat)
        self._max_episode_steps = None if max_episode_steps is None else int(max_episode_steps)
        self._episode_steps = 0
        self._reset_next_step = True

    @abc.abstractmethod
    def _reset_env(self) -> Any:
        """Resets the wrapped simulator; returns its first observation."""

    @abc.abstractmethod
    def _step_env(self, action: Any) -> Tuple[float, float, Any, bool]:
        """One step of the wrapped simulator: (reward, discount, observation, whether the episode ended)."""

    @abc.abstractmethod
    def _flatten(self, observation: Any) -> np.ndarray:
        """The simulator's observation as a flat float32 vector."""

    def reset(self) -> dm_env.TimeStep:
        """Starts a new episode."""
        self._episode_steps = 0
        self._reset_next_step = False
        return dm_env.TimeStep(dm_env.StepType.FIRST, None, None, self._flatten(self._reset_env()))

    def step(self, action: Any) -> dm_env.TimeStep:
        """Applies an action (action_repeat times); after a LAST step, starts a new episode instead."""
        if self._reset_next_step:
            return self.reset()
        reward, discount = 0.0, 1.0
        for _ in range(self._action_repeat):
            step_reward, step_discount, observation, last = self._step_env(action)
            reward += step_reward
            discount *= step_discount
            if last:
                break
        self._episode_steps += 1
        if self._max_episode_steps is not None and self._episode_steps >= self._max_episode_steps:
            last = True  # truncation: the discount stays as the simulator gave it
        self._reset_next_step = last
        step_type = dm_env.StepType.LAST if last else dm_env.StepType.MID
        return dm_env.TimeStep(step_type, np.float32(reward), np.float32(discount), self._flatten(observation))

    def observation_spec(self) -> specs.Array:
        """The flat float32 observation spec."""
        return self._observation_spec

    def action_spec(self) -> specs.Array:
        """The action spec (BoundedArray for continuous actions, DiscreteArray for discrete ones)."""
        return self._action_spec

    def close(self) -> None:
        """Releases the wrapped simulator."""
        self._env.close()
