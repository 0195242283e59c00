"""Publishing off the learner's SGD path: a background thread that holds at most one pending version.

The learner hands each version to `BackgroundPublisher.submit` and goes on with
its next SGD step; the thread quantizes, serializes and inserts. When the
thread is still busy with an older version, a newer submission replaces the
unsent one (counted in `dropped`): actors only ever want the newest weights,
and versions reach the server in increasing order.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, NamedTuple, Optional, Sequence

from actorq_jax.replay.variables import PublishStats, VariablePublisher

log = logging.getLogger(__name__)


class PublishTotals(NamedTuple):
    """What the background publisher did so far."""

    published: int  # versions inserted into the variables table
    dropped: int  # versions replaced by a newer one before they were sent
    nbytes: int  # payload bytes of every published version
    publish_s: float  # seconds spent quantizing, serializing and inserting
    last_version: int  # newest version on the server (-1 before the first)
    errors: int  # publications that raised (logged; the next version is tried)


class _Pending(NamedTuple):
    params: Any
    version: int
    evaluation: bool
    meta: Optional[Dict[str, float]]


class BackgroundPublisher:
    """Publishes `(params, version)` to one or more variable tables from a background thread.

    `publishers[0]` gets every version; the others (e.g. the evaluator's float
    table) only versions submitted with `evaluation=True` (or that replaced one).
    """

    def __init__(self, publishers: Sequence[VariablePublisher]):
        if not publishers:
            raise ValueError("BackgroundPublisher needs at least one VariablePublisher")
        self._publishers = list(publishers)
        self._cond = threading.Condition()
        self._pending: Optional[_Pending] = None
        self._busy = False
        self._closing = False
        self._last_submitted = -1
        self._published = self._dropped = self._nbytes = self._errors = 0
        self._publish_s = 0.0
        self._last_version = -1
        self._thread = threading.Thread(target=self._run, name="BackgroundPublisher", daemon=True)
        self._thread.start()

    def submit(self, params: Any, version: int, evaluation: bool = False,
               meta: Optional[Dict[str, float]] = None) -> None:
        """Queues a version (with `meta` numbers for the actors' payload) and returns at once; replaces an unsent one."""
        with self._cond:
            if self._closing:
                raise RuntimeError("BackgroundPublisher is closed")
            # The same version again is allowed (e.g. once more for the evaluator at shutdown); older ones are not.
            if version < self._last_submitted:
                raise ValueError(f"versions must not go back: got {version} after {self._last_submitted}")
            self._last_submitted = version
            if self._pending is not None:
                self._dropped += 1
                # The newer version stands in for the dropped one everywhere, the evaluator's table included.
                evaluation = evaluation or self._pending.evaluation
            self._pending = _Pending(params, int(version), evaluation, meta)
            self._cond.notify_all()

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Waits until nothing is queued or being sent; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout=timeout_s)

    def close(self, timeout_s: float = 120.0) -> bool:
        """Publishes what is queued (the final version), then stops the thread; False if it did not finish in time."""
        done = self.flush(timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=max(0.1, timeout_s))
        return done and not self._thread.is_alive()

    def totals(self) -> PublishTotals:
        """Counters for logging (learner.csv)."""
        with self._cond:
            return PublishTotals(self._published, self._dropped, self._nbytes, self._publish_s,
                                 self._last_version, self._errors)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closing)
                if self._pending is None:
                    return  # closing with nothing left to send
                job, self._pending, self._busy = self._pending, None, True
            start = time.perf_counter()
            stats: Optional[PublishStats] = None
            try:
                stats = self._publishers[0].publish(job.params, job.version, meta=job.meta)
                if job.evaluation:
                    for publisher in self._publishers[1:]:
                        publisher.publish(job.params, job.version)
            except Exception as error:  # a failed publication must not kill the learner: log, count, go on
                log.warning("publishing version %d failed: %s", job.version, error)
            elapsed = time.perf_counter() - start
            with self._cond:
                self._busy = False
                self._publish_s += elapsed
                if stats is None:
                    self._errors += 1
                else:
                    self._published += 1
                    self._nbytes += stats.nbytes
                    self._last_version = job.version
                self._cond.notify_all()
