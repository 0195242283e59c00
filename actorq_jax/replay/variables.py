"""Quantized variable server: the learner publishes policy weights, actors refresh them.

The variables table (make_variables_table) holds one item: the latest policy as
``actorq_jax.quantization.to_wire`` arrays, whose header carries the version (the
learner step). Publishing replaces it; actors sample it without removing it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import numpy as np
import reverb

from actorq_jax.quantization import QuantConfig, from_wire, quantize, to_wire, wire_nbytes
from actorq_jax.quantization.wire import wire_meta
from actorq_jax.replay.messages import sample_one
from actorq_jax.replay.server import parse_address

log = logging.getLogger(__name__)
# Before the first weights arrive, update() asks the server at most this often.
_FIRST_POLL_S = 0.1


class PayloadRejected(ValueError):
    """A variables payload that is malformed or does not fit the receiving network."""


class PublishStats(NamedTuple):
    """What one publish cost: payload bytes and seconds per stage."""

    version: int
    nbytes: int
    quantize_s: float
    serialize_s: float
    insert_s: float


class RefreshTiming(NamedTuple):
    """What one actor refresh cost, in seconds per stage (see VariableClient)."""

    version: int
    nbytes: int
    pull_s: float
    deserialize_s: float
    load_s: float
    # CPU seconds of the refresh thread in each stage (wall above CPU: waiting on the server, or for a core).
    pull_cpu_s: float = 0.0
    deserialize_cpu_s: float = 0.0
    load_cpu_s: float = 0.0


# How long one publication may wait for the server to confirm it (a stopped or hung server never does).
INSERT_TIMEOUT_S = 60.0


def insert_wire(client: reverb.Client, table: str, arrays: List[np.ndarray],
                timeout_s: float = INSERT_TIMEOUT_S) -> None:
    """Inserts one list of wire arrays as the table's item, each array stored as is (DeadlineExceededError when
    the server has not confirmed it within `timeout_s`)."""
    # A fresh writer each time: the header's shape changes between versions, and a
    # writer's columns keep the first shape they saw.
    writer = client.trajectory_writer(num_keep_alive_refs=1, validate_items=False)
    try:
        writer.append(list(arrays))
        writer.create_item(table=table, priority=1.0,
                           trajectory=[column[-1] for column in writer.history])
        writer.end_episode(timeout_ms=max(1, int(timeout_s * 1000)))
    finally:
        writer.close()


class VariablePublisher:
    """The learner's side: quantize at the actors' bits, serialize, insert into the variables table."""

    def __init__(self, client: reverb.Client, table: str = "variables",
                 config: QuantConfig = QuantConfig(bits=8), timeout_s: float = INSERT_TIMEOUT_S):
        if not isinstance(config, QuantConfig):
            raise ValueError(f"config must be a QuantConfig, got {config!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got timeout_s={timeout_s!r}")
        self._client = client
        self.table = table
        self.config = config
        self.timeout_s = timeout_s
        self.published = 0

    def publish(self, params: Any, version: int, meta: Optional[Dict[str, float]] = None) -> PublishStats:
        """Publishes params (a float32 pytree) as `version` (with `meta` numbers); returns bytes and stage times."""
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"version must be an int >= 0, got version={version!r}")
        from actorq_jax.finite import first_non_finite

        problem = first_non_finite(params, "parameter ")
        if problem:
            # Actors would reject it anyway and go on with stale weights, looking alive: refuse at the source.
            raise ValueError(f"refusing to publish version {version}: {problem}")
        t0 = time.perf_counter()
        qparams = quantize(params, self.config)
        t1 = time.perf_counter()
        arrays = to_wire(qparams, int(version), meta=meta)  # to_wire waits for the device values
        t2 = time.perf_counter()
        insert_wire(self._client, self.table, arrays, self.timeout_s)
        t3 = time.perf_counter()
        self.published += 1
        return PublishStats(version=int(version), nbytes=wire_nbytes(arrays),
                            quantize_s=t1 - t0, serialize_s=t2 - t1, insert_s=t3 - t2)


class VariableClient:
    """An actor's view of the latest published policy, refreshed in a background thread.

    Call `update()` once per env step (`update(steps=K)` for K at once): every `update_period` steps (and every 0.1 s
    until the first weights arrive) it asks the background thread for a refresh and
    returns at once; `update(wait=True)` refreshes now and blocks. A refresh pulls the
    item from Reverb, decodes it with `from_wire(arrays, like)` and passes the result
    to `load_fn` (default: as is), e.g. dequantize, or pack kernels and
    `jax.block_until_ready`. A refresh that finds the version already held skips the
    pull (the table's insert count did not move) or the load (same version).

    Errors: the last good `params` are kept; the error is re-raised (as RuntimeError,
    chained) by the next `update()`/`refresh()` call when `raise_errors` (default),
    otherwise logged and counted in `errors`. A payload that is malformed or does
    not fit `like` also counts in `rejected` and is logged once (the same item is
    not pulled again, nor decoded again after `reconnect()`); an unreachable server is logged once per outage.
    Thread-safe: `params`, `version` and `timings` may be read from any thread.
    """

    def __init__(self, address: str, table: str = "variables", update_period: int = 1000,
                 like: Any = None, load_fn: Optional[Callable[[Any], Any]] = None,
                 raise_errors: bool = True, rpc_timeout_s: float = 2.0):
        parse_address(address)
        if isinstance(update_period, bool) or not isinstance(update_period, int) or update_period < 1:
            raise ValueError(f"update_period must be an int >= 1, got update_period={update_period!r}")
        self.address = address
        self.table = table
        self.update_period = update_period
        self._like = like
        self._load_fn = load_fn
        self._raise_errors = raise_errors
        self._rpc_timeout = max(1, math.ceil(rpc_timeout_s))
        self._client = reverb.Client(address)
        self._cond = threading.Condition()
        self._params: Any = None
        self._version: Optional[int] = None
        self._seen_inserts = -1
        self._rejected_key: Optional[int] = None
        self._timings: List[RefreshTiming] = []
        self._error: Optional[BaseException] = None
        self._requested = 0
        self._completed = 0
        self._next_poll = 0.0
        self._stopping = False
        self._meta: Dict[str, float] = {}
        self._unreachable = False
        self.steps = 0
        self.errors = 0
        self.rejected = 0
        self.skipped = 0
        self._thread = threading.Thread(target=self._run, name=f"VariableClient[{address}]",
                                        daemon=True)
        self._thread.start()

    # -- reading ----------------------------------------------------------------------

    @property
    def params(self) -> Any:
        """The latest loaded params (None before the first refresh that found weights)."""
        with self._cond:
            return self._params

    @property
    def version(self) -> Optional[int]:
        """Version of `params` (None before the first)."""
        with self._cond:
            return self._version

    @property
    def meta(self) -> Dict[str, float]:
        """The "meta" numbers published with `params` ({} when none)."""
        with self._cond:
            return dict(self._meta)

    def reconnect(self) -> None:
        """Talks to the server through a fresh client (after the learner restarted at the same address)."""
        with self._cond:
            self._client = reverb.Client(self.address)
            self._seen_inserts = -1  # a restored table's insert count can repeat an old one

    @property
    def timings(self) -> List[RefreshTiming]:
        """One RefreshTiming per refresh that loaded a new version, oldest first."""
        with self._cond:
            return list(self._timings)

    # -- driving ----------------------------------------------------------------------

    def update(self, wait: bool = False, steps: int = 1) -> None:
        """Counts `steps` env steps; each time the count passes a multiple of update_period, starts a background refresh."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got steps={steps!r}")
        self._raise_pending_error()
        self.steps += steps
        if wait:
            self.refresh()
            return
        with self._cond:
            idle = self._completed == self._requested
            if self._params is None:
                # Poll for the first weights, but not at every env step.
                now = time.monotonic()
                due = now >= self._next_poll
                if due and idle:
                    self._next_poll = now + _FIRST_POLL_S
            else:
                due = self.steps // self.update_period != (self.steps - steps) // self.update_period
            if due and idle:
                self._request_locked()

    def refresh(self, timeout_s: Optional[float] = None) -> bool:
        """Refreshes now and blocks; True when a refresh completed within timeout_s."""
        with self._cond:
            target = self._request_locked()
            done = self._cond.wait_for(lambda: self._completed >= target or self._stopping,
                                       timeout=timeout_s)
        self._raise_pending_error()
        return bool(done) and not self._stopping

    def wait_for_first(self, timeout_s: float = 60.0, poll_s: float = 0.1,
                       stopped: Callable[[], bool] = lambda: False) -> Any:
        """Blocks until params exist and returns them; None once `stopped()` is true first; TimeoutError if none
        within timeout_s."""
        deadline = time.monotonic() + timeout_s
        cause: Optional[BaseException] = None
        while self.params is None:
            if stopped():
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                self.refresh(timeout_s=remaining)
            except RuntimeError as error:  # unreachable server: keep trying until the deadline
                cause = error.__cause__ or error
            if self.params is None:
                time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        params = self.params
        if params is None:
            raise TimeoutError(
                f"no variables published on {self.address} table {self.table} after "
                f"{timeout_s:g} s" + (f" (last error: {cause})" if cause else "")) from cause
        return params

    def stop(self, timeout_s: Optional[float] = None) -> None:
        """Stops the background thread, waiting for a call in progress (default: rpc_timeout_s + 1 s)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=self._rpc_timeout + 1 if timeout_s is None else timeout_s)

    def __enter__(self) -> "VariableClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- background thread ----------------------------------------------------------

    def _request_locked(self) -> int:
        self._requested += 1
        self._cond.notify_all()
        return self._requested

    def _raise_pending_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None and self._raise_errors:
            raise RuntimeError(
                f"variable refresh from {self.address} table {self.table} failed: {error}") from error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._requested > self._completed or self._stopping)
                if self._stopping:
                    return
                target = self._requested
            try:
                self._refresh_once()
                self._unreachable = False
            except Exception as error:  # surfaced to the actor thread by update()/refresh()
                self._note_error(error)
            with self._cond:
                self._completed = target
                self._cond.notify_all()

    def _note_error(self, error: BaseException) -> None:
        if isinstance(error, PayloadRejected):
            log.warning("rejected the variables payload on %s table %s (keeping version %s): %s",
                         self.address, self.table, self.version, error.__cause__)
        elif not (isinstance(error, ConnectionError) and self._unreachable):
            log.warning("variable refresh from %s failed: %s", self.address, error)
        with self._cond:
            self._error = error
            self.errors += 1
            self.rejected += isinstance(error, PayloadRejected)
            self._unreachable = isinstance(error, ConnectionError)

    def _refresh_once(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        with self._cond:
            client = self._client
        try:
            infos = client.server_info(timeout=self._rpc_timeout)
        except reverb.DeadlineExceededError as error:
            raise ConnectionError(
                f"no Reverb server answered at {self.address} within {self._rpc_timeout} s") from error
        if self.table not in infos:
            raise ValueError(f"table {self.table!r} not found on {self.address}; tables: {sorted(infos)}")
        info = infos[self.table]
        if info.current_size == 0:
            return  # nothing published yet
        inserts = info.rate_limiter_info.insert_stats.completed
        if inserts == self._seen_inserts:
            self.skipped += 1
            return
        try:
            # Bounded: a server that restarts between the size check and the sample has an empty table.
            sample = sample_one(client, self.table, self._rpc_timeout)
        except reverb.DeadlineExceededError as error:
            raise ConnectionError(
                f"no policy came from table {self.table!r} at {self.address} within {self._rpc_timeout} s") from error
        arrays = list(sample.data)
        t1, c1 = time.perf_counter(), time.thread_time()
        # A bad item is rejected once: its insert count is not pulled again, and its key is not decoded again
        # after a reconnect (a paused or restored service can still hold it until the learner's next publish).
        self._seen_inserts = inserts
        key = int(np.asarray(sample.info.key).reshape(-1)[0])
        if key == self._rejected_key:
            self.skipped += 1
            return
        try:
            qparams, version = from_wire(arrays, like=self._like)
            meta = wire_meta(arrays)
        except ValueError as error:
            self._rejected_key = key
            raise PayloadRejected(str(error)) from error
        t2, c2 = time.perf_counter(), time.thread_time()
        if version == self.version:
            self.skipped += 1
            return
        params = qparams if self._load_fn is None else self._load_fn(qparams)
        t3, c3 = time.perf_counter(), time.thread_time()
        timing = RefreshTiming(version=version, nbytes=wire_nbytes(arrays), pull_s=t1 - t0,
                               deserialize_s=t2 - t1, load_s=t3 - t2,
                               pull_cpu_s=c1 - c0, deserialize_cpu_s=c2 - c1, load_cpu_s=c3 - c2)
        with self._cond:
            self._params = params
            self._version = version
            self._meta = meta
            self._timings.append(timing)
