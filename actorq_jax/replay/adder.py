"""N-step transition adder: an actor's timesteps and actions -> Transition items in Reverb."""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

import numpy as np
import reverb

from actorq_jax.replay.server import parse_address

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

    The item for step t is created once o_{t+n} is written; when the episode ends
    (a LAST timestep) the remaining m < n steps are written with m-step rewards and
    discounts. A terminal step (env discount 0) cuts the bootstrap (discount 0); a
    truncation (LAST with discount > 0) keeps it. Observations and actions are
    written once per step and items reference them; only the n-step reward and
    discount are written per item. Each env step is one writer append (o_t with a_t, and
    the reward/discount of the item o_t completes), so o_{t+1} reaches the writer with
    a_{t+1} or at the episode's end.

    `reset()` abandons an unfinished episode: items already created are still sent,
    the last (< n) steps whose n-step return is unknown are dropped.

    Items are created `chunk_length` at a time (and whenever the adder flushes or an episode ends),
    so Reverb sends each column's data for those steps as one chunk: a replay service then stores,
    checkpoints and streams one chunk per column per `chunk_length` steps instead of one per step.
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
        self._specs = _table_specs(client, table, connect_timeout_s)
        self._chunk_length = chunk_length
        # The farthest an item reaches back: o_t is n steps before o_{t+n}, plus up to n-1 extra per-item
        # steps appended at the end of an episode, plus the chunk_length - 1 steps an item may wait.
        # Items are checked against the table's signature here (_cast), not again by the writer.
        self._keep_alive = 2 * n_step + 1 + chunk_length
        self._writer = client.trajectory_writer(num_keep_alive_refs=self._keep_alive, validate_items=False)
        self._configured: Set[str] = set()  # columns given the fixed chunk length
        self._columns: Optional[Tuple[Any, ...]] = None
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
        """Starts an episode at a FIRST timestep (o_0 is written with a_0)."""
        _check_timestep(timestep)
        if self._in_episode:
            raise ValueError(
                "add_first called in the middle of an episode; call reset() to abandon it first")
        if not timestep.first():
            raise ValueError(f"add_first needs a FIRST timestep, got step_type={timestep.step_type!r}")
        self._pending = self._cast("observation", timestep.observation)
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
        # One writer step per env step: o_t with a_t, plus the n-step reward/discount of the item
        # that o_t completes (o_{t-n}'s). o_{t+1} waits for a_{t+1} (or the episode's end).
        self._write_step(self._cast("action", action), priority)
        self._rewards.append(reward)
        self._discounts.append(env_discount)
        self.steps_added += 1
        self._pending = self._cast("observation", next_timestep.observation)
        if next_timestep.last():
            t_last = self._t
            self._write_step(None, priority)  # o_T, and o_{T-n}'s item
            # The last min(n, T) - 1 (or, for T < n, all T) steps have no o_{t+n}:
            # each gets a step of its own holding its m-step reward/discount.
            for t in range(max(t_last - self._n + 1, 0), t_last):
                self._append(self._item_values(t, t_last))
                self._queue_item(t, t_last, priority)
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
            if self._in_episode and self._t >= self._n:
                self._write_step(None, self._priority)  # the item the last observation completes
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
        self._pending: Optional[np.ndarray] = None  # o_t, written with a_t
        self._t = 0  # episode index of the pending observation (= its writer step)
        self._appended = 0  # writer steps of this episode (the episode's end adds steps without an observation)
        # Complete items not yet handed to the writer: (t, t_next, writer step of their reward, priority).
        self._queued: List[Tuple[int, int, int, float]] = []
        # r_{k+1}, d_{k+1} of the last n env transitions.
        self._rewards: Deque[float] = collections.deque(maxlen=self._n)
        self._discounts: Deque[float] = collections.deque(maxlen=self._n)

    def _write_step(self, action: Optional[np.ndarray], priority: float) -> None:
        """Appends the pending observation's step (with a_t unless None) and creates the item it completes."""
        t, first = self._t, self._t - self._n
        step = {"observation": self._pending}
        if action is not None:
            step["action"] = action
        if first >= 0:
            step.update(self._item_values(first, t))
        self._append(step)
        self._pending = None
        self._t += 1
        if first >= 0:
            self._queue_item(first, t, priority)

    def _append(self, step: Dict[str, np.ndarray]) -> None:
        self._writer.append(step)
        self._appended += 1
        if self._chunk_length > 1 and len(self._configured) < 4:  # once per column: not on every env step
            for name in step:
                if name not in self._configured:
                    # Reverb's auto-tuned chunks stay one step long here; a fixed length lets a group share one.
                    self._writer.configure((name,), num_keep_alive_refs=self._keep_alive,
                                           max_chunk_length=self._chunk_length)
                    self._configured.add(name)

    def _queue_item(self, t: int, t_next: int, priority: float) -> None:
        """Queues the item from o_t to o_{t_next} whose reward and discount the last writer step holds."""
        self._queued.append((t, t_next, self._appended - 1, priority))
        if len(self._queued) >= self._chunk_length:
            self._send_queued()

    def _send_queued(self) -> None:
        """Hands every queued item to the writer (its data goes out as one chunk per column)."""
        queued, self._queued = self._queued, []
        for t, t_next, value_step, priority in queued:
            self._create_item(t, t_next, value_step, priority)

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

    def _item_values(self, t: int, t_next: int) -> Dict[str, np.ndarray]:
        """The n-step reward and discount of the item from o_t to o_{t_next}."""
        # rewards/discounts deques hold transitions t_next-len .. t_next-1.
        offset = t_next - len(self._rewards)
        total, scale = 0.0, 1.0
        for k in range(t - offset, t_next - offset):
            total += scale * self._rewards[k]
            scale *= self._gamma * self._discounts[k]
        return {"reward": np.float32(total), "discount": np.float32(scale)}

    def _create_item(self, t: int, t_next: int, value_step: int, priority: float) -> None:
        """Item (o_t, a_t, reward/discount of writer step value_step, o_{t_next}); o_k sits at writer step k."""
        if self._columns is None:
            history = self._writer.history  # rebuilt on every access: keep its columns once all exist
            self._columns = tuple(history[f] for f in ("observation", "action", "reward", "discount"))
        obs_col, act_col, reward_col, discount_col = self._columns
        self._writer.create_item(
            table=self._table,
            priority=priority,
            trajectory={
                "observation": obs_col[t],
                "action": act_col[t],
                "reward": reward_col[value_step],
                "discount": discount_col[value_step],
                "next_observation": obs_col[t_next],
            })
        self.items_written += 1

    def _cast(self, field: str, value: Any) -> np.ndarray:
        dtype, shape = self._specs[field]
        array = np.asarray(value, dtype=dtype)
        if array.shape != shape:
            raise ValueError(
                f"{field} has shape {array.shape} but table {self._table!r} expects {shape}")
        return array


def _check_timestep(timestep: Any) -> None:
    missing = [name for name in _REQUIRED if not hasattr(timestep, name)]
    if missing:
        raise ValueError(f"expected a dm_env.TimeStep, got {type(timestep).__name__} missing {missing}")


def _table_specs(client: reverb.Client, table: str,
                 timeout_s: float) -> Dict[str, Tuple[np.dtype, Tuple[int, ...]]]:
    """(dtype, shape) of the observation and action columns from the table's signature."""
    parse_address(client.server_address)
    try:
        infos = client.server_info(timeout=max(1, int(np.ceil(timeout_s))))
    except reverb.DeadlineExceededError as error:
        raise TimeoutError(
            f"no Reverb server answered at {client.server_address} within {timeout_s:g} s") from error
    if table not in infos:
        raise ValueError(
            f"table {table!r} not found on {client.server_address}; tables: {sorted(infos)}")
    signature = infos[table].signature
    if not signature or "observation" not in signature or "action" not in signature:
        raise ValueError(
            f"table {table!r} on {client.server_address} has no Transition signature "
            f"(build it with make_replay_table)")
    return {name: (signature[name].dtype.as_numpy_dtype, tuple(signature[name].shape))
            for name in ("observation", "action")}
