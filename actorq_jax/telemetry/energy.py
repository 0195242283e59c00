"""Energy and carbon accounting of a run with codecarbon, offline."""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from pathlib import Path
from typing import Dict, FrozenSet, Optional, Union

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
_TRACKING_MODES = ("machine", "process")


@functools.lru_cache(maxsize=1)
def known_country_codes() -> FrozenSet[str]:
    """ISO 3166-1 alpha-3 codes that codecarbon has an offline energy mix for."""
    from codecarbon.input import DataSource

    return frozenset(DataSource().get_global_energy_mix_data())


def _quiet_codecarbon() -> None:
    # codecarbon logs INFO/WARNING lines from its constructor, before its own
    # log_level takes effect (e.g. about the unrecognised "AMD EPYC" CPU here).
    logging.getLogger("codecarbon").setLevel(logging.ERROR)


def _call_unsuppressed(method, *args):
    # codecarbon decorates start/stop with a decorator that logs and swallows
    # every exception; the undecorated function (kept in __wrapped__) lets the
    # reason reach us. Falls back to the public method if that changes.
    return getattr(method, "__wrapped__", method)(*args)


class EnergyTracker:
    """Measures energy (kWh) and emissions (kg CO2eq) between start() and stop().

    Wraps codecarbon's OfflineEmissionsTracker (no network; carbon intensity
    from the country's energy mix). Where RAPL is unreadable, codecarbon
    estimates CPU power from load. tracking_mode "machine" counts the whole
    machine, which is what a multi-process run needs; "process" counts only
    this process. codecarbon also writes `emissions.csv` into output_dir.

    An unknown country code raises ValueError at construction. If codecarbon
    itself fails in start() or stop(), a warning with the reason is logged
    and stop() reports NaN energy and emissions (duration_s is always this
    object's own wall-clock measurement), so a long run is never lost to its
    energy meter.
    """

    def __init__(
        self,
        output_dir: PathLike,
        country_iso_code: str = "USA",
        tracking_mode: str = "machine",
        project_name: str = "actorq",
        measure_power_secs: float = 15.0,
    ):
        if not isinstance(country_iso_code, str) or country_iso_code.upper() not in known_country_codes():
            raise ValueError(
                f"unknown country_iso_code {country_iso_code!r}: expected an ISO 3166-1 alpha-3 "
                "code that codecarbon knows, e.g. USA, FRA, DEU, GBR, CAN, IND, CHN"
            )
        if tracking_mode not in _TRACKING_MODES:
            raise ValueError(f"tracking_mode must be one of {_TRACKING_MODES}, got {tracking_mode!r}")
        measure_power_secs = float(measure_power_secs)
        if not measure_power_secs > 0:
            raise ValueError(f"measure_power_secs must be > 0, got {measure_power_secs!r}")
        self._output_dir = Path(output_dir)
        self._country = country_iso_code.upper()
        self._tracking_mode = tracking_mode
        self._project_name = str(project_name)
        self._measure_power_secs = measure_power_secs
        self._tracker = None
        self._failed: Optional[str] = None
        self._start_time: Optional[float] = None
        self._result: Optional[Dict[str, float]] = None

    def start(self) -> None:
        """Starts measuring (takes about a second while codecarbon probes the hardware)."""
        if self._start_time is not None:
            raise RuntimeError("EnergyTracker already started")
        self._result = None
        self._failed = None
        self._start_time = time.perf_counter()
        self._output_dir.mkdir(parents=True, exist_ok=True)
        _quiet_codecarbon()
        try:
            from codecarbon import OfflineEmissionsTracker

            self._tracker = OfflineEmissionsTracker(
                country_iso_code=self._country,
                output_dir=str(self._output_dir),
                tracking_mode=self._tracking_mode,
                project_name=self._project_name,
                measure_power_secs=self._measure_power_secs,
                log_level="error",
                # Tests and several runs on one machine must not fight over
                # codecarbon's global lock file.
                allow_multiple_runs=True,
            )
            _call_unsuppressed(type(self._tracker).start, self._tracker)
        # Any failure inside codecarbon (hardware probing, psutil, pandas, file
        # I/O) must not stop a training run: report it and carry on without energy.
        except Exception as e:  # noqa: BLE001
            self._fail("start", e)
            if self._tracker is not None:
                # Best effort to stop any sampler threads a half-finished start
                # left behind; the public stop() logs instead of raising.
                self._tracker.stop()

    def _fail(self, where: str, error: BaseException) -> None:
        self._failed = f"{type(error).__name__}: {error}"
        log.warning(
            "codecarbon failed in %s (%s); energy and emissions will be reported as NaN",
            where,
            self._failed,
        )

    @property
    def failure(self) -> Optional[str]:
        """Why codecarbon failed in this measurement, or None."""
        return self._failed

    def stop(self) -> Dict[str, float]:
        """Stops measuring; returns energy_kwh, emissions_kg and duration_s (NaN where codecarbon failed)."""
        if self._start_time is None:
            raise RuntimeError("EnergyTracker.stop() called before start()")
        duration = time.perf_counter() - self._start_time
        self._start_time = None
        energy = emissions = math.nan
        if self._failed is None and self._tracker is not None:
            try:
                _call_unsuppressed(type(self._tracker).stop, self._tracker)
                data = getattr(self._tracker, "final_emissions_data", None)
                if data is None:
                    raise RuntimeError("codecarbon produced no emissions data")
                energy = float(data.energy_consumed)
                emissions = float(data.emissions)
            # As in start(): codecarbon's failures must not crash the run.
            except Exception as e:  # noqa: BLE001
                self._fail("stop", e)
        self._tracker = None
        self._result = {"energy_kwh": energy, "emissions_kg": emissions, "duration_s": duration}
        return dict(self._result)

    @property
    def result(self) -> Optional[Dict[str, float]]:
        """What the last stop() returned, or None."""
        return None if self._result is None else dict(self._result)

    def __enter__(self) -> "EnergyTracker":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._start_time is not None:
            self.stop()
