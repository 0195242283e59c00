"""Reverb tables of the ActorQ data plane: the replay table and the variables table."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import numpy as np
import reverb
import tensorflow as tf

from actorq_jax.replay.packing import packed_signature


@dataclasses.dataclass(frozen=True)
class ReplayTableConfig:
    """How the replay table samples, removes and rate-limits.

    Fields:
      name: table name on the server.
      max_size: most items held; the oldest (FIFO) is removed beyond it.
      min_size: items the table must hold before the learner may sample.
      samples_per_insert: target samples per inserted item (the rate limiter blocks
        whichever side runs ahead); None -> no ratio, only the minimum size.
      error_tolerance: how far (in samples) the ratio may drift before a side blocks;
        None -> max(1, spi, 0.1 * spi * min_size), i.e. a 10% slack on the warm-up.
      prioritized: False -> uniform sampling (D4PG); True -> prioritized (DQN).
      priority_exponent: the alpha of prioritized sampling (ignored when uniform).
      max_times_sampled: an item is removed after this many samples (0: never; FIFO
        removal at max_size still applies). With samples_per_insert None this is the
        QuaRL paper's actorQ regime: actors insert freely, the learner samples each
        item at most this often.
    """

    name: str = "replay"
    max_size: int = 1_000_000
    min_size: int = 1000
    samples_per_insert: Optional[float] = 32.0
    error_tolerance: Optional[float] = None
    prioritized: bool = False
    priority_exponent: float = 0.6
    max_times_sampled: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ReplayTableConfig.name must be a non-empty str, got name={self.name!r}")
        if not isinstance(self.max_size, int) or self.max_size < 1:
            raise ValueError(f"ReplayTableConfig.max_size must be an int >= 1, got max_size={self.max_size!r}")
        if not isinstance(self.min_size, int) or not 1 <= self.min_size <= self.max_size:
            raise ValueError(
                f"ReplayTableConfig.min_size must be an int in [1, max_size={self.max_size}], "
                f"got min_size={self.min_size!r}")
        if self.samples_per_insert is not None and not self.samples_per_insert > 0:
            raise ValueError(
                f"ReplayTableConfig.samples_per_insert must be > 0 or None, "
                f"got samples_per_insert={self.samples_per_insert!r}")
        if self.error_tolerance is not None:
            floor = max(1.0, self.samples_per_insert or 1.0)
            if not self.error_tolerance >= floor:
                raise ValueError(
                    f"ReplayTableConfig.error_tolerance must be >= max(1, samples_per_insert) = {floor} "
                    f"(smaller values can block both sides), got error_tolerance={self.error_tolerance!r}")
        if not self.priority_exponent >= 0:
            raise ValueError(
                f"ReplayTableConfig.priority_exponent must be >= 0, "
                f"got priority_exponent={self.priority_exponent!r}")

        if isinstance(self.max_times_sampled, bool) or not isinstance(self.max_times_sampled, int) \
                or self.max_times_sampled < 0:
            raise ValueError(
                f"ReplayTableConfig.max_times_sampled must be an int >= 0, "
                f"got max_times_sampled={self.max_times_sampled!r}")

    @property
    def effective_error_tolerance(self) -> float:
        """The error buffer handed to Reverb's SampleToInsertRatio."""
        if self.error_tolerance is not None:
            return float(self.error_tolerance)
        spi = self.samples_per_insert or 1.0
        return float(max(1.0, spi, 0.1 * spi * self.min_size))

    def rate_limiter(self) -> reverb.rate_limiters.RateLimiter:
        """The table's rate limiter (SampleToInsertRatio, or MinSize without a ratio)."""
        if self.samples_per_insert is None:
            return reverb.rate_limiters.MinSize(self.min_size)
        return reverb.rate_limiters.SampleToInsertRatio(
            samples_per_insert=float(self.samples_per_insert),
            min_size_to_sample=self.min_size,
            error_buffer=self.effective_error_tolerance)


def transition_signature(observation_example: np.ndarray,
                         action_example: np.ndarray) -> Dict[str, tf.TensorSpec]:
    """The replay table's item signature (one Transition, keyed by field name)."""
    obs = np.asarray(observation_example)
    act = np.asarray(action_example)
    if obs.dtype == object or act.dtype == object:
        raise ValueError(
            f"observation/action examples must be numeric arrays, got dtypes {obs.dtype} and {act.dtype}")
    obs_spec = tf.TensorSpec(obs.shape, tf.as_dtype(obs.dtype))
    return {
        "observation": obs_spec,
        "action": tf.TensorSpec(act.shape, tf.as_dtype(act.dtype)),
        "reward": tf.TensorSpec([], tf.float32),
        "discount": tf.TensorSpec([], tf.float32),
        "next_observation": obs_spec,
    }


def make_replay_table(config: ReplayTableConfig, observation_example: np.ndarray,
                      action_example: np.ndarray) -> reverb.Table:
    """A replay table of n-step Transitions: uniform (or prioritized) sampling, FIFO removal."""
    return make_item_table(config, transition_signature(observation_example, action_example))


def make_item_table(config: ReplayTableConfig, signature: Dict[str, tf.TensorSpec]) -> reverb.Table:
    """A replay table of items with `signature` (field -> spec), packed per dtype (see packing.py): uniform (or
    prioritized) sampling, FIFO removal."""
    if config.prioritized:
        sampler = reverb.selectors.Prioritized(config.priority_exponent)
    else:
        sampler = reverb.selectors.Uniform()
    return reverb.Table(
        name=config.name,
        sampler=sampler,
        remover=reverb.selectors.Fifo(),
        max_size=config.max_size,
        max_times_sampled=config.max_times_sampled,
        rate_limiter=config.rate_limiter(),
        signature=packed_signature(signature))


def make_variables_table(name: str = "variables") -> reverb.Table:
    """A size-1 LIFO table holding the latest published policy (a list of wire arrays).

    No signature: the number and shapes of wire arrays depend on the bits. Sampling
    never removes the item, so once published the table always answers.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"variables table name must be a non-empty str, got name={name!r}")
    return reverb.Table(
        name=name,
        sampler=reverb.selectors.Lifo(),
        remover=reverb.selectors.Fifo(),
        max_size=1,
        rate_limiter=reverb.rate_limiters.MinSize(1))
