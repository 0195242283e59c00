"""N-step transition adder: an actor's timesteps and actions -> Transition items in Reverb."""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np
import reverb

from actorq_jax.replay.server import parse_address, table_layout
from actorq_jax.replay.types import Transition

_REQUIRED = ("step_type", "reward", "discount", "observation")


class WriteTimeout(TimeoutError):
    """The server did not confirm the adder's items in time: it is gone, or its rate limiter holds inserts.

    The items stay queued in the writer; `wait()` waits for them again.
    """


def _timeout_ms(timeout_s: Optional[float], default_ms: Optional[int]) -> Optional[int]:
    """A call's deadline in ms: `timeout_s` when given, else the adder's."""
    return default_ms if timeout_s is None else max(1, int(timeout_s * 1000))


class NStepAdder:
    """Writes one n-step Transition item per environment step through a TrajectoryWriter.

    Usage (dm_env timesteps)::

        adder.add_first(timestep)
        while not timestep.last():
            action = policy(timestep.observation)
            timestep = env.step(action)
            adder.add(action, timestep)

    The item for step t is complete once o_{t+n} arrives; when the episode ends
    (a LAST timestep) the remaining m < n steps get items with m-step rewards and
    discounts. A terminal step (env discount 0) cuts the bootstrap (discount 0); a
    truncation (LAST with discount > 0) keeps it. The adder keeps the last n + 1
    observations and n actions itself and writes each complete item as one packed row
    (o_t, a_t, R, D, o_{t+m}; see packing.py) that the item references alone, because the
    service's and the learner's work per sample grows with the columns an item references.

    `reset()` abandons an unfinished episode: items already created are still sent,
    the last (< n) steps whose n-step return is unknown are dropped.

    Items are written `chunk_length` at a time (and whenever the adder flushes or an episode ends),
    so Reverb sends their rows as one chunk per column: a replay service then stores,
    checkpoints and streams one chunk per column per `chunk_length` items instead of one per item.
    An item reaches the server at most `chunk_length - 1` env steps later than it could.

    Every `max_in_flight_items / 2` items (every item when that is 0 or 1), `add` waits
    until at most `max_in_flight_items` await the server: it blocks while the table's
    rate limiter refuses inserts (the learner is behind). With `timeout_s`, no call
    blocks longer than that: a wait that runs out raises WriteTimeout (the caller
    tells a busy server from a gone one); None waits as long as it takes.
    """

    def __init__(self, client: reverb.Client, table: str, n_step: int, discount: float,
                 priority: float = 1.0, max_in_flight_items: int = 16,
                 connect_timeout_s: float = 30.0, timeout_s: Optional[float] = None,
                 chunk_length: int = 16):
        if isinstance(chunk_length, bool) or not isinstance(chunk_length, int) or chunk_length < 1:
            raise ValueError(f"chunk_length must be an int >= 1, got chunk_length={chunk_length!r}")
        if isinstance(n_step, bool) or not isinstance(n_step, int) or n_step < 1:
            raise ValueError(f"n_step must be an int >= 1, got n_step={n_step!r}")
        if not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got discount={discount!r}")
        if not priority >= 0:
            raise ValueError(f"priority must be >= 0, got priority={priority!r}")
        if max_in_flight_items < 0:
            raise ValueError(f"max_in_flight_items must be >= 0, got {max_in_flight_items!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got timeout_s={timeout_s!r}")
        self.timeout_s = timeout_s
        self._timeout_ms = _timeout_ms(timeout_s, None)
        self._client = client
        self._table = table
        self._n = n_step
        self._gamma = float(discount)
        self._priority = float(priority)
        self._max_in_flight = int(max_in_flight_items)
        parse_address(client.server_address)
        self._layout = table_layout(client, table, Transition._fields, connect_timeout_s)
        self._chunk_length = chunk_length
        # An item references only its own row, written at most chunk_length rows ago.
        # Rows are checked against the table's signature here (_cast, pack), not again by the writer.
        self._writer = client.trajectory_writer(num_keep_alive_refs=chunk_length, validate_items=False)
        if chunk_length > 1:
            for column in self._layout.columns:
                # Reverb's auto-tuned chunks stay one row long here; a fixed length lets a group share one.
                self._writer.configure((column,), num_keep_alive_refs=chunk_length, max_chunk_length=chunk_length)
        # Waiting for the server every step costs a round trip per step; every few items bounds the
        # items in flight just as well (at most max_in_flight_items + flush_every).
        self._flush_every = max(1, self._max_in_flight // 2)
        self._flushed_at = 0
        self.items_written = 0
        self.steps_added = 0
        self.episodes = 0
        # Seconds spent blocked until the server took our items: the rate limiter's hold when it refuses
        # inserts (the learner is behind), otherwise about zero. The rest of a call's time is the write itself.
        self.wait_s = 0.0
        self._start_episode_state()

    # -- public API -----------------------------------------------------------------

    @property
    def priority(self) -> float:
        """Priority of the items written next (prioritized replay inserts at the largest seen so far)."""
        return self._priority

    @priority.setter
    def priority(self, value: float) -> None:
        if not value >= 0:
            raise ValueError(f"priority must be >= 0, got priority={value!r}")
        self._priority = float(value)

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Blocks until at most `max_in_flight_items` items await the server (WriteTimeout past `timeout_s`,
        default the adder's timeout_s)."""
        self._send_queued()
        self._flush(self._max_in_flight, timeout_s)

    def add_first(self, timestep: Any) -> None:
        """Starts an episode at a FIRST timestep."""
        _check_timestep(timestep)
        if self._in_episode:
            raise ValueError(
                "add_first called in the middle of an episode; call reset() to abandon it first")
        if not timestep.first():
            raise ValueError(f"add_first needs a FIRST timestep, got step_type={timestep.step_type!r}")
        self._observations.append(self._cast("observation", timestep.observation))
        self._in_episode = True

    def add(self, action: Any, next_timestep: Any, priority: Optional[float] = None) -> None:
        """Records a_t and the timestep it led to; writes the items that became complete."""
        _check_timestep(next_timestep)
        if not self._in_episode:
            raise ValueError("add called before add_first (or after the episode ended)")
        if next_timestep.first():
            raise ValueError("add got a FIRST timestep; start a new episode with add_first")
        priority = self._priority if priority is None else float(priority)
        if not priority >= 0:
            raise ValueError(f"priority must be >= 0, got priority={priority!r}")
        reward = float(np.asarray(next_timestep.reward if next_timestep.reward is not None else 0.0))
        env_discount = float(np.asarray(
            next_timestep.discount if next_timestep.discount is not None else 1.0))
        # Both checked before anything is kept: a bad value leaves the episode as it was.
        action = self._cast("action", action)
        observation = self._cast("observation", next_timestep.observation)
        self._actions.append(action)
        self._rewards.append(reward)
        self._discounts.append(env_discount)
        self._observations.append(observation)
        self._t += 1
        self.steps_added += 1
        if self._t >= self._n:
            self._queue_item(self._t - self._n, priority)
        if next_timestep.last():
            # The last min(n, T) - 1 (or, for T < n, all T) steps have no o_{t+n}: m-step items.
            for t in range(max(self._t - self._n + 1, 0), self._t):
                self._queue_item(t, priority)
            try:
                self._end_episode()
            finally:
                # Reverb resets the episode even when the wait for its items runs out.
                self.episodes += 1
                self._start_episode_state()
        elif self.items_written - self._flushed_at >= self._flush_every:
            self._flushed_at = self.items_written
            self._flush(self._max_in_flight)

    def reset(self, timeout_s: Optional[float] = None) -> None:
        """Abandons the current episode (see class doc) and flushes created items (within `timeout_s`, default
        the adder's timeout_s)."""
        try:
            self._end_episode(timeout_s)
        finally:
            self._start_episode_state()

    def close(self, flush: bool = True, timeout_s: Optional[float] = None) -> None:
        """Flushes created items (within `timeout_s`, default the adder's; not with flush=False) and closes the
        writer."""
        if self._writer is not None:
            try:
                if flush:
                    self.reset(timeout_s)
            finally:
                self._writer.close()
                self._writer = None

    def __enter__(self) -> "NStepAdder":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------

    def _start_episode_state(self) -> None:
        self._in_episode = False
        self._t = 0  # episode index of the newest observation
        # o_{t-n} .. o_t, a_{t-n} .. a_{t-1}, and r_{k+1}, d_{k+1} of the last n transitions.
        self._observations: Deque[np.ndarray] = collections.deque(maxlen=self._n + 1)
        self._actions: Deque[np.ndarray] = collections.deque(maxlen=self._n)
        self._rewards: Deque[float] = collections.deque(maxlen=self._n)
        self._discounts: Deque[float] = collections.deque(maxlen=self._n)
        # Complete items not yet handed to the writer: (packed row, priority).
        self._queued: List[Tuple[Dict[str, np.ndarray], float]] = []

    def _queue_item(self, t: int, priority: float) -> None:
        """Queues the item from o_t to the newest observation (an n-step one, or m < n at an episode's end)."""
        reward, discount = self._item_values(t, self._t)
        row = self._layout.pack({
            "observation": self._observations[t - self._t - 1],
            "action": self._actions[t - self._t],
            "reward": reward,
            "discount": discount,
            "next_observation": self._observations[-1],
        })
        self._queued.append((row, priority))
        if len(self._queued) >= self._chunk_length:
            self._send_queued()

    def _send_queued(self) -> None:
        """Writes every queued row, then creates their items (the rows go out as one chunk per column)."""
        queued, self._queued = self._queued, []
        for row, _ in queued:
            self._writer.append(row)
        if not queued:
            return
        history = self._writer.history  # rebuilt on every access: once per group
        columns = [history[column] for column in self._layout.columns]
        for k, (_, priority) in enumerate(queued):
            back = k - len(queued)
            self._writer.create_item(table=self._table, priority=priority,
                                     trajectory={c: col[back] for c, col in zip(self._layout.columns, columns)})
            self.items_written += 1

    def _end_episode(self, timeout_s: Optional[float] = None) -> None:
        timeout_ms = _timeout_ms(timeout_s, self._timeout_ms)
        self._send_queued()
        self._flushed_at = self.items_written
        try:
            self._wait_for_server(lambda: self._writer.end_episode(clear_buffers=True, timeout_ms=timeout_ms),
                                  "the episode's items", timeout_ms)
        except WriteTimeout:
            # When the wait runs out, Reverb's writer still starts a new episode (its items go on in the
            # background) but raises before clearing its Python-side column history, so the next episode's
            # step k would name the old episode's released step k (a None reference). Clear it as it would.
            for column in getattr(self._writer, "_column_history", ()):
                column.reset()
            raise

    def _flush(self, pending: int, timeout_s: Optional[float] = None) -> None:
        timeout_ms = _timeout_ms(timeout_s, self._timeout_ms)
        self._wait_for_server(lambda: self._writer.flush(block_until_num_items=pending, timeout_ms=timeout_ms),
                              "items", timeout_ms)

    def _wait_for_server(self, call: Callable[[], None], what: str, timeout_ms: Optional[int]) -> None:
        """Runs a writer call that blocks until the server takes our items; its time counts as wait_s."""
        start = time.perf_counter()
        try:
            call()
        except reverb.DeadlineExceededError as error:
            raise WriteTimeout(f"{self._client.server_address} did not confirm {what} "
                               f"within {timeout_ms} ms") from error
        finally:
            self.wait_s += time.perf_counter() - start

    def _item_values(self, t: int, t_next: int) -> Tuple[np.float32, np.float32]:
        """The m-step reward and discount of the item from o_t to o_{t_next}."""
        # rewards/discounts deques hold transitions t_next-len .. t_next-1.
        offset = t_next - len(self._rewards)
        total, scale = 0.0, 1.0
        for k in range(t - offset, t_next - offset):
            total += scale * self._rewards[k]
            scale *= self._gamma * self._discounts[k]
        return np.float32(total), np.float32(scale)

    def _cast(self, field: str, value: Any) -> np.ndarray:
        dtype, shape = self._layout.spec(field)
        array = np.asarray(value, dtype=dtype)
        if array.shape != shape:
            raise ValueError(
                f"{field} has shape {array.shape} but table {self._table!r} expects {shape}")
        return array


def _check_timestep(timestep: Any) -> None:
    missing = [name for name in _REQUIRED if not hasattr(timestep, name)]
    if missing:
        raise ValueError(f"expected a dm_env.TimeStep, got {type(timestep).__name__} missing {missing}")


