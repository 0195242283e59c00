"""Atomic JSON files for configs and summaries."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Union

import numpy as np

PathLike = Union[str, "os.PathLike[str]"]


def to_jsonable(obj: Any) -> Any:
    """Converts numpy values, dataclasses, tuples and paths to plain JSON types; NaN/inf -> None."""
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        # Strict JSON has no NaN or Infinity; null keeps every reader working.
        return obj if math.isfinite(obj) else None
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, dict):
        return {_key(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"cannot write a {type(obj).__name__} to JSON: {obj!r}")


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, (bool, int, float, np.generic)):
        return str(to_jsonable(key))
    raise TypeError(f"JSON object keys must be strings or numbers, got {type(key).__name__}: {key!r}")


def write_json(path: PathLike, obj: Any, indent: int = 2) -> None:
    """Writes obj as strict JSON atomically (temp file, fsync, os.replace); NaN/inf become null.

    numpy scalars and arrays, tuples, dataclass instances and paths are
    converted (see to_jsonable); other types raise TypeError before anything
    is written. Readers never see a half-written file.
    """
    text = json.dumps(to_jsonable(obj), indent=indent, allow_nan=False) + "\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        # Re-raised after cleanup, whatever it was (including KeyboardInterrupt).
        os.unlink(tmp)
        raise
