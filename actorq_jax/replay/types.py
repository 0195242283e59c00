"""Data types shared by the replay plane: the transition every item holds."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Transition(NamedTuple):
    """One n-step transition (o_t, a_t, R, D, o_{t+m}).

    Convention (the learner's target is ``reward + discount * V(next_observation)``):
      reward:   sum_{k<m} gamma^k * (prod_{j<k} d_{t+j+1}) * r_{t+k+1}; with dm_env
                semantics (env discount 1 everywhere but a terminal last step) this is
                sum_{k<m} gamma^k r_{t+k+1}.
      discount: gamma^m * prod_{k<m} d_{t+k+1}, so 0 after a terminal step and
                gamma^m after a time-limit truncation.
    where m = n, or fewer at the end of an episode. Fields are numpy arrays; a batch
    from ``ReplayDataset`` stacks them along a leading batch axis.
    """

    observation: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    discount: np.ndarray
    next_observation: np.ndarray
