"""A plain summary of an environment's observation and action spaces."""

from __future__ import annotations

import dataclasses
from typing import Optional

import dm_env
import numpy as np
from dm_env import specs


@dataclasses.dataclass(frozen=True, eq=False)
class EnvironmentSpec:
    """Sizes and bounds an agent needs to build its networks and clip its actions.

    Attributes:
      observation_dim: length of the flat float32 observation vector.
      discrete: True for a single integer action in [0, num_actions).
      action_dim: number of continuous action components; None when discrete.
      num_actions: number of discrete actions; None when continuous.
      action_minimum: lower action bounds, read-only; float32 of shape
        (action_dim,) when continuous, int32 of shape () (always 0) when discrete.
      action_maximum: upper action bounds, read-only; float32 of shape
        (action_dim,) when continuous, int32 of shape () (num_actions - 1) when
        discrete.
    """

    observation_dim: int
    discrete: bool
    action_dim: Optional[int]
    num_actions: Optional[int]
    action_minimum: np.ndarray
    action_maximum: np.ndarray

    def __eq__(self, other: object) -> bool:
        # The generated __eq__ would compare arrays elementwise and fail on bool().
        if not isinstance(other, EnvironmentSpec):
            return NotImplemented
        return (
            self.observation_dim == other.observation_dim
            and self.discrete == other.discrete
            and self.action_dim == other.action_dim
            and self.num_actions == other.num_actions
            and np.array_equal(self.action_minimum, other.action_minimum)
            and np.array_equal(self.action_maximum, other.action_maximum)
        )

    __hash__ = None  # type: ignore[assignment]  # holds arrays: not hashable


def _readonly(array: np.ndarray) -> np.ndarray:
    array = np.array(array)  # a private copy, so freezing it cannot affect the caller
    array.setflags(write=False)
    return array


def environment_spec(env: dm_env.Environment) -> EnvironmentSpec:
    """Builds the EnvironmentSpec of a flat-observation dm_env environment."""
    obs_spec = env.observation_spec()
    if not isinstance(obs_spec, specs.Array) or len(obs_spec.shape) != 1:
        raise ValueError(
            f"environment_spec needs a flat observation spec (one rank-1 Array), got {obs_spec!r}"
        )
    action_spec = env.action_spec()
    if isinstance(action_spec, specs.DiscreteArray):
        return EnvironmentSpec(
            observation_dim=int(obs_spec.shape[0]),
            discrete=True,
            action_dim=None,
            num_actions=int(action_spec.num_values),
            action_minimum=_readonly(np.asarray(0, dtype=np.int32)),
            action_maximum=_readonly(np.asarray(action_spec.num_values - 1, dtype=np.int32)),
        )
    if isinstance(action_spec, specs.BoundedArray) and len(action_spec.shape) == 1:
        shape = action_spec.shape
        return EnvironmentSpec(
            observation_dim=int(obs_spec.shape[0]),
            discrete=False,
            action_dim=int(shape[0]),
            num_actions=None,
            action_minimum=_readonly(np.broadcast_to(action_spec.minimum, shape).astype(np.float32)),
            action_maximum=_readonly(np.broadcast_to(action_spec.maximum, shape).astype(np.float32)),
        )
    raise ValueError(
        "environment_spec needs a DiscreteArray or a rank-1 BoundedArray action spec, "
        f"got {action_spec!r}"
    )
