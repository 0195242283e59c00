"""The learner's side of replay: batches of Transitions (or another item type), and writing priorities back."""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import numpy as np
import reverb

from actorq_jax.replay.server import table_layout, wait_for_server
from actorq_jax.replay.types import Transition


class ReplayBatch(NamedTuple):
    """A batch with its sampling info (from ReplayDataset(with_info=True)).

    data: Transition (or the dataset's item type) of arrays stacked on a leading batch axis.
    keys: uint64 [B] item keys, for update_priorities.
    probabilities: float64 [B] probability each item had of being sampled.
    table_size: int64 [B] table size when each item was sampled (for IS weights:
      w = (table_size * probability) ** -beta, normalised by its max).
    """

    data: Any
    keys: np.ndarray
    probabilities: np.ndarray
    table_size: np.ndarray


class ReplayDataset:
    """An iterator of batches (Transition of numpy arrays, or ReplayBatch with_info) from a table.

    `item_type` is the NamedTuple the table's items fill, field by field (default: the n-step
    Transition); the table's signature must have exactly its fields.
    Built on reverb.TrajectoryDataset (TF) from the table's packed signature, batched with
    drop_remainder and prefetched, and unpacked into the item's fields (numpy views).
    `max_in_flight_samples` (default 2 * batch_size) is how many samples each worker requests at once.
    `rate_limiter_timeout_ms` >= 0 ends the iteration (StopIteration) once the rate limiter has refused a
    sample for that long; -1 waits forever, as a learner does.
    """

    def __init__(self, address: str, table: str, batch_size: int, prefetch: int = 2,
                 with_info: bool = False, num_workers: int = -1,
                 rate_limiter_timeout_ms: int = -1, connect_timeout_s: float = 30.0,
                 max_in_flight_samples: Optional[int] = None, item_type: Any = Transition):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got batch_size={batch_size!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got prefetch={prefetch!r}")
        client = wait_for_server(address, connect_timeout_s)
        self._layout = table_layout(client, table, item_type._fields, connect_timeout_s)
        self.address = address
        self.table = table
        self.batch_size = batch_size
        self.with_info = with_info
        self.item_type = item_type
        signature = self._layout.table_signature()  # the server's columns, as the layout read them
        dataset = reverb.TrajectoryDataset(
            server_address=address,
            table=table,
            dtypes={k: spec.dtype for k, spec in signature.items()},
            shapes={k: spec.shape for k, spec in signature.items()},
            # Two batches in flight keep the pipe full without skewing sampling much.
            max_in_flight_samples_per_worker=max_in_flight_samples or 2 * batch_size,
            num_workers_per_iterator=num_workers,
            rate_limiter_timeout_ms=rate_limiter_timeout_ms)
        dataset = dataset.batch(batch_size, drop_remainder=True)
        if prefetch:
            dataset = dataset.prefetch(prefetch)
        self._iterator = dataset.as_numpy_iterator()

    def __iter__(self) -> Iterator[Union[Transition, ReplayBatch]]:
        return self

    def __next__(self) -> Union[Transition, ReplayBatch]:
        sample = next(self._iterator)
        data = self.item_type(**self._layout.unpack(sample.data))
        if not self.with_info:
            return data
        return ReplayBatch(data=data, keys=sample.info.key, probabilities=sample.info.probability,
                           table_size=sample.info.table_size)


def update_priorities(client: reverb.Client, table: str, keys: Sequence[int],
                      priorities: Sequence[float]) -> None:
    """Sets the priorities of the items with these keys (keys no longer in the table are ignored)."""
    keys = np.asarray(keys, dtype=np.uint64).reshape(-1)
    priorities = np.asarray(priorities, dtype=np.float64).reshape(-1)
    if keys.shape != priorities.shape:
        raise ValueError(
            f"keys and priorities must have the same length, got {keys.shape[0]} and {priorities.shape[0]}")
    if not np.all(np.isfinite(priorities)) or np.any(priorities < 0):
        bad = priorities[~(np.isfinite(priorities) & (priorities >= 0))]
        raise ValueError(f"priorities must be finite and >= 0, got {bad[:5].tolist()}")
    # Duplicated keys (an item sampled twice in a batch) keep the last priority.
    updates = {int(k): float(p) for k, p in zip(keys, priorities)}
    client.mutate_priorities(table, updates=updates)
