"""Records: the small files of finished runs, kept so that tables and figures can be redrawn without the runs.

A record set lives in `results/records/<study>/`:

    study.json            where each collected sweep came from, its command, when it ran and was collected, the CPU
    sweeps/<name>.json    the sweep's own sweep.json (its command and each run's command and start time)
    <run>/config.json, summary.json, eval.csv, learner.csv, actors/actor_<i>.csv

Checkpoints, replay checkpoints, logs and codecarbon's files are left out. Only
finished runs (those with summary.json) are collected. Needs no JAX.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Union

from actorq_jax.analysis.loading import SWEEP_INDEX, find_run_dirs, is_run_dir
from actorq_jax.run_dir import STOP_EVENT, RunDir
from actorq_jax.telemetry.machine import cpu_id, cpu_model

PathLike = Union[str, Path]
RECORD_FILES = (RunDir.CONFIG, RunDir.SUMMARY, RunDir.EVAL_CSV, RunDir.LEARNER_CSV)
RECORD_GLOBS = (f"{RunDir.ACTORS}/{RunDir.ACTOR_CSV_GLOB}",)
STUDY_INDEX = "study.json"


def record_files(run_dir: PathLike) -> List[Path]:
    """The files of one run that make its record, relative to the run directory."""
    root = Path(run_dir)
    files = [Path(name) for name in RECORD_FILES if (root / name).is_file()]
    for pattern in RECORD_GLOBS:
        files += sorted(p.relative_to(root) for p in root.glob(pattern) if p.is_file())
    return files


def _read_index(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error


def stopped_before_budget(summary: Dict[str, Any]) -> bool:
    """Whether a run's summary says a stop request ended it before its budget."""
    return any(str(event).startswith(STOP_EVENT) for event in summary.get("events", []))


def finished_runs(source: PathLike) -> List[Path]:
    """The run folders under `source` (or `source` itself) that finished their budget: those `collect` records."""
    finished = []
    for run_dir in find_run_dirs(Path(source)):
        summary_path = RunDir(run_dir).summary
        if summary_path.is_file() and not stopped_before_budget(json.loads(summary_path.read_text())):
            finished.append(run_dir)
    return finished


def collect(source: PathLike, records_root: PathLike, study: str) -> List[Path]:
    """Copies the finished runs of a sweep (or one run) directory into records_root/study; returns the records written.

    A run already recorded under the same name is replaced, so collecting a
    sweep again while it runs adds the runs that have finished since. A run
    that is still going (no summary) or was stopped before its budget is left out;
    a source with no finished run at all is a ValueError, and nothing is written.
    """
    src = Path(source)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory")
    if not study or "/" in study or study.startswith("."):
        raise ValueError(f"study must be a plain folder name, got {study!r}")
    runs = finished_runs(src)
    if not runs:
        raise ValueError(f"{src} holds no finished run (a run folder whose summary.json says it ran its budget)")
    out = Path(records_root) / study
    out.mkdir(parents=True, exist_ok=True)
    # One run of a sweep, collected on its own, is recorded under its sweep (its command is the sweep's).
    home = src.parent if is_run_dir(src) and (src.parent / SWEEP_INDEX).is_file() else src
    # Another source's run of the same name (two end-to-end grids both have d4pg_pinned_q8_s0) is kept:
    # this source's copy is recorded under "<source>_<run>".
    taken = {name for source_name, info in _read_index(out / STUDY_INDEX).get("sources", {}).items()
             if source_name != home.name for name in info.get("runs_collected", [])}
    written = []
    for run_dir in runs:
        target = out / (run_dir.name if run_dir.name not in taken else f"{home.name}_{run_dir.name}")
        if target.exists():
            shutil.rmtree(target)
        for relative in record_files(run_dir):
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(run_dir / relative, target / relative)
        written.append(target)
    sweep_index = _read_index(home / SWEEP_INDEX)
    if sweep_index:
        (out / "sweeps").mkdir(exist_ok=True)
        shutil.copyfile(home / SWEEP_INDEX, out / "sweeps" / f"{home.name}.json")
    index_path = out / STUDY_INDEX
    index = _read_index(index_path)
    index.setdefault("study", study)
    index.setdefault("sources", {})
    earlier = index["sources"].get(home.name, {}).get("runs_collected", []) if home != src else []
    index["sources"][home.name] = {
        "command": sweep_index.get("command"),
        "started": sweep_index.get("started"),
        "finished": sweep_index.get("finished"),
        "runs_collected": sorted(set(earlier) | {p.name for p in written}),
        "collected": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "collected_on": {"cpu": cpu_model(), "cpu_id": cpu_id(), "cores": os.cpu_count()},
    }
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return written


def read_study(study_dir: PathLike) -> Dict[str, Any]:
    """A record set's study.json (empty when it has none)."""
    return _read_index(Path(study_dir) / STUDY_INDEX)
