"""Per-phase wall-clock accounting for actor and learner loops."""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict


class _Phase:
    """Accumulator and reusable context manager for one phase name."""

    __slots__ = ("name", "total", "count", "_start", "_clock")

    def __init__(self, name: str, clock: Callable[[], float]):
        self.name = name
        self.total = 0.0
        self.count = 0
        self._start = None
        self._clock = clock

    def __enter__(self) -> "_Phase":
        if self._start is not None:
            # One shared start time per phase: nesting or sharing it across
            # threads would silently corrupt the totals.
            raise RuntimeError(
                f"phase {self.name!r} is already running (phases do not nest within "
                "themselves; from other threads use PhaseTimer.add)"
            )
        self._start = self._clock()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.total += self._clock() - self._start
        self.count += 1
        self._start = None
        return False


class PhaseTimer:
    """Accumulates seconds and call counts per named phase.

    `with timer.phase("env_step"): ...` times a block with time.perf_counter;
    the context object is cached per name, so the overhead is a few hundred
    nanoseconds and nothing is allocated per call. A phase is meant for the
    thread that owns the timer and does not nest within itself (that raises
    RuntimeError); different phase names nest freely. Durations measured
    elsewhere, e.g. in a background thread, go through `add`, which is
    thread-safe. Totals include an exception-exited block's time. `clock`
    (seconds, default time.perf_counter) is injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._phases: Dict[str, _Phase] = {}
        self._added_totals: Dict[str, float] = {}
        self._added_counts: Dict[str, int] = {}
        self._lock = threading.Lock()

    def phase(self, name: str) -> _Phase:
        """Returns the context manager that times one block under `name`."""
        try:
            return self._phases[name]
        except KeyError:
            if not isinstance(name, str) or not name:
                raise ValueError(f"phase name must be a non-empty string, got {name!r}") from None
            return self._phases.setdefault(name, _Phase(name, self._clock))

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        """Adds a duration measured elsewhere to phase `name` (thread-safe)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty string, got {name!r}")
        seconds = float(seconds)
        if not seconds >= 0.0:  # also rejects NaN
            raise ValueError(f"seconds must be a non-negative number, got {seconds!r} for {name!r}")
        with self._lock:
            self._added_totals[name] = self._added_totals.get(name, 0.0) + seconds
            self._added_counts[name] = self._added_counts.get(name, 0) + int(count)

    def _merged(self, attr: str, added: dict) -> dict:
        out = {name: getattr(p, attr) for name, p in list(self._phases.items()) if p.count}
        with self._lock:
            for name, value in added.items():
                out[name] = out.get(name, 0) + value
        return out

    def totals(self) -> Dict[str, float]:
        """Seconds accumulated per phase name since creation or the last reset."""
        return self._merged("total", self._added_totals)

    def counts(self) -> Dict[str, int]:
        """Number of timed blocks (or add calls) per phase name."""
        return self._merged("count", self._added_counts)

    def reset(self) -> None:
        """Zeroes every phase (a phase running now keeps timing into the new period)."""
        for p in list(self._phases.values()):
            p.total = 0.0
            p.count = 0
        with self._lock:
            self._added_totals.clear()
            self._added_counts.clear()
