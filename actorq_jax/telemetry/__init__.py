"""Run telemetry: phase timers, CSV streams, energy, a progress line, JSON files."""

from actorq_jax.telemetry.csv_logger import CsvLogger, read_csv
from actorq_jax.telemetry.energy import EnergyTracker, known_country_codes
from actorq_jax.telemetry.jsonio import to_jsonable, write_json
from actorq_jax.telemetry.progress import ProgressLine
from actorq_jax.telemetry.schema import ACTOR_FIELDS, ACTOR_PHASES, EVAL_FIELDS
from actorq_jax.telemetry.timer import PhaseTimer

__all__ = [
    "ACTOR_FIELDS",
    "ACTOR_PHASES",
    "EVAL_FIELDS",
    "CsvLogger",
    "EnergyTracker",
    "PhaseTimer",
    "ProgressLine",
    "known_country_codes",
    "read_csv",
    "to_jsonable",
    "write_json",
]
