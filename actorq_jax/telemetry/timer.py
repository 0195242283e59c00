"""Per-phase wall-clock and CPU-time accounting for actor and learner loops.

Wall time alone cannot tell a phase that got slower from one whose process was
descheduled (two processes sharing a core); the thread's CPU time beside it can:
a phase whose wall time grows while its CPU time does not was starved, not slowed.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict


class _Phase:
    """Accumulator and reusable context manager for one phase name."""

    __slots__ = ("name", "total", "cpu_total", "count", "_start", "_cpu_start", "_clock", "_cpu_clock")

    def __init__(self, name: str, clock: Callable[[], float], cpu_clock: Callable[[], float]):
        self.name = name
        self.total = 0.0
        self.cpu_total = 0.0
        self.count = 0
        self._start = None
        self._cpu_start = 0.0
        self._clock = clock
        self._cpu_clock = cpu_clock

    def __enter__(self) -> "_Phase":
        if self._start is not None:
            # One shared start time per phase: nesting or sharing it across
            # threads would silently corrupt the totals.
            raise RuntimeError(
                f"phase {self.name!r} is already running (phases do not nest within "
                "themselves; from other threads use PhaseTimer.add)"
            )
        self._start = self._clock()
        self._cpu_start = self._cpu_clock()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.total += self._clock() - self._start
        self.cpu_total += self._cpu_clock() - self._cpu_start
        self.count += 1
        self._start = None
        return False


class PhaseTimer:
    """Accumulates seconds and call counts per named phase.

    `with timer.phase("env_step"): ...` times a block with time.perf_counter, and the
    process's CPU time with time.process_time (XLA runs a jitted call's compute on threads
    of its own, which the calling thread's clock would miss; whatever other threads of the
    process compute meanwhile counts too);
    the context object is cached per name, so the overhead is a few hundred
    nanoseconds and nothing is allocated per call. A phase is meant for the
    thread that owns the timer and does not nest within itself (that raises
    RuntimeError); different phase names nest freely. Durations measured
    elsewhere, e.g. in a background thread, go through `add`, which is
    thread-safe. Totals include an exception-exited block's time. `clock`
    and `cpu_clock` (seconds) are injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._phases: Dict[str, _Phase] = {}
        self._added_totals: Dict[str, float] = {}
        self._added_cpu: Dict[str, float] = {}
        self._added_counts: Dict[str, int] = {}
        self._lock = threading.Lock()

    def phase(self, name: str) -> _Phase:
        """Returns the context manager that times one block under `name`."""
        try:
            return self._phases[name]
        except KeyError:
            if not isinstance(name, str) or not name:
                raise ValueError(f"phase name must be a non-empty string, got {name!r}") from None
            return self._phases.setdefault(name, _Phase(name, self._clock, self._cpu_clock))

    def add(self, name: str, seconds: float, count: int = 1, cpu_seconds: float = 0.0) -> None:
        """Adds a duration (and the CPU time it took, when known) measured elsewhere to phase `name` (thread-safe)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty string, got {name!r}")
        seconds = float(seconds)
        if not seconds >= 0.0:  # also rejects NaN
            raise ValueError(f"seconds must be a non-negative number, got {seconds!r} for {name!r}")
        with self._lock:
            self._added_totals[name] = self._added_totals.get(name, 0.0) + seconds
            self._added_cpu[name] = self._added_cpu.get(name, 0.0) + float(cpu_seconds)
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

    def cpu_totals(self) -> Dict[str, float]:
        """CPU seconds of the process while each phase ran (or as added), since creation or the last reset."""
        return self._merged("cpu_total", self._added_cpu)

    def counts(self) -> Dict[str, int]:
        """Number of timed blocks (or add calls) per phase name."""
        return self._merged("count", self._added_counts)

    def reset(self) -> None:
        """Zeroes every phase (a phase running now keeps timing into the new period)."""
        for p in list(self._phases.values()):
            p.total = 0.0
            p.cpu_total = 0.0
            p.count = 0
        with self._lock:
            self._added_totals.clear()
            self._added_cpu.clear()
            self._added_counts.clear()
