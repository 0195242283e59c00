"""Append-only CSV streams that survive a killed process and resume cleanly."""

from __future__ import annotations

import csv
import io
import logging
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

PathLike = Union[str, "os.PathLike[str]"]


def _read_header(path: Path) -> Optional[List[str]]:
    with open(path, "r", newline="") as f:
        first = f.readline()
    if not first.endswith("\n"):
        return None  # empty, or a header cut short by a kill: rewrite it
    return next(csv.reader([first]))


def _drop_partial_last_line(path: Path) -> None:
    # A process killed mid-write can leave half a row; appending after it
    # would glue the next row onto it, so the fragment is cut off.
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        chunk = 1 << 16
        end = size
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            data = f.read(end - start)
            idx = data.rfind(b"\n")
            if idx >= 0:
                f.truncate(start + idx + 1)
                return
            end = start
        f.truncate(0)


class CsvLogger:
    """Writes dict rows to a CSV file with a fixed header.

    A new (or empty) file gets the header; an existing file must have exactly
    the same header and is appended to, so a resumed run continues its file
    (a different header raises ValueError). Rows are buffered and flushed to
    the OS by a background thread every `flush_every_s` seconds and on
    close(), so a killed process loses at most the rows of the last interval;
    `flush_every_s=0` flushes every row and starts no thread. Not fsynced:
    rows survive a killed process, not a power cut.

    Unknown keys raise ValueError naming them; missing keys and None values
    are written as empty fields. Values are written with str(). Thread-safe.

    `keep_older_header=True` lets a file written before columns were added
    continue: when every column of its header is among `fieldnames`, rows
    go on in the file's own columns and the newer ones (`dropped_columns`)
    are left out, instead of a ValueError that would stop a resumed run.
    """

    def __init__(self, path: PathLike, fieldnames: Sequence[str], flush_every_s: float = 2.0,
                 keep_older_header: bool = False):
        fieldnames = list(fieldnames)
        if not fieldnames:
            raise ValueError(f"CsvLogger for {path}: fieldnames must not be empty")
        bad = [name for name in fieldnames if not isinstance(name, str) or not name]
        if bad:
            raise ValueError(f"CsvLogger for {path}: fieldnames must be non-empty strings, got {bad!r}")
        if len(set(fieldnames)) != len(fieldnames):
            dupes = sorted({n for n in fieldnames if fieldnames.count(n) > 1})
            raise ValueError(f"CsvLogger for {path}: duplicate fieldnames {dupes}")
        flush_every_s = float(flush_every_s)
        if not flush_every_s >= 0.0:
            raise ValueError(f"flush_every_s must be >= 0, got {flush_every_s!r}")

        self._path = Path(path)
        self._fieldnames = tuple(fieldnames)
        self._fieldset = frozenset(fieldnames)  # the keys a row may have (also those an older file leaves out)
        self.dropped_columns: tuple = ()
        self._flush_every_s = flush_every_s
        self._path.parent.mkdir(parents=True, exist_ok=True)

        write_header = True
        if self._path.exists() and self._path.stat().st_size > 0:
            existing = _read_header(self._path)
            if existing is not None:
                older = set(existing) <= self._fieldset and len(set(existing)) == len(existing)
                if existing != fieldnames and not (keep_older_header and older):
                    raise ValueError(
                        f"{self._path} already has header {existing}, which differs from "
                        f"the requested {fieldnames}; use another file"
                    )
                self._fieldnames = tuple(existing)
                self.dropped_columns = tuple(name for name in fieldnames if name not in existing)
                _drop_partial_last_line(self._path)
                write_header = False
        self._file: Optional[io.TextIOWrapper] = open(
            self._path, "w" if write_header else "a", newline="", encoding="utf-8"
        )
        self._writer = csv.writer(self._file)
        if write_header:
            self._writer.writerow(self._fieldnames)
            self._file.flush()

        self._lock = threading.Lock()
        self._dirty = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if flush_every_s > 0:
            self._thread = threading.Thread(
                target=self._flush_loop, name=f"CsvLogger-flush:{self._path.name}", daemon=True
            )
            self._thread.start()

    @property
    def path(self) -> Path:
        """The file being written."""
        return self._path

    @property
    def fieldnames(self) -> tuple:
        """The header, in column order."""
        return self._fieldnames

    @property
    def closed(self) -> bool:
        """Whether close() has been called."""
        return self._file is None

    def _flush_loop(self) -> None:
        while not self._stop.wait(self._flush_every_s):
            self.flush()

    def write(self, row: Mapping[str, Any]) -> None:
        """Appends one row; keys must be among the fieldnames."""
        unknown = [key for key in row if key not in self._fieldset]
        if unknown:
            raise ValueError(
                f"unknown CSV column(s) {unknown} for {self._path}; known: {list(self._fieldnames)}"
            )
        values = [row.get(name, "") for name in self._fieldnames]
        with self._lock:
            if self._file is None:
                raise RuntimeError(f"CsvLogger for {self._path} is closed")
            self._writer.writerow(values)
            if self._flush_every_s == 0:
                self._file.flush()
            else:
                self._dirty = True

    def flush(self) -> None:
        """Pushes buffered rows to the OS now."""
        with self._lock:
            if self._file is not None and self._dirty:
                self._file.flush()
                self._dirty = False

    def close(self) -> None:
        """Flushes, stops the flusher thread and closes the file (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> "CsvLogger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


def open_run_csv(path: PathLike, fieldnames: Sequence[str], flush_every_s: float = 2.0) -> CsvLogger:
    """A CsvLogger for one of a run's streams that a resumed run made by older code can continue (without the
    columns its file lacks; a warning names them)."""
    logger = CsvLogger(path, fieldnames, flush_every_s=flush_every_s, keep_older_header=True)
    if logger.dropped_columns:
        logging.getLogger(__name__).warning(
            "%s predates the columns %s; the resumed run goes on without them", logger.path, list(logger.dropped_columns))
    return logger


def parse_field(value: Optional[str]) -> Any:
    """One CSV field as read_csv returns it: an int, a float, a string, or None when empty."""
    if value is None or value == "":  # None: a short row (DictReader's restval)
        return None
    if "_" in value:  # int() and float() accept digit separators ("1_000"); a name like "q_8" stays a name
        return value
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def read_csv(path: PathLike) -> List[Dict[str, Any]]:
    """The rows of a CSV file with a header line, as dicts of parsed values ([] when the file does not exist).

    Keys are the header's column names, in its order. A field becomes an int
    if int() parses it, else a float if float() does (nan and inf included),
    else it stays a string; a field holding "_" always stays a string; empty
    fields, and the missing fields of a short row, become None. A last line
    without a line ending (a row still being written, or cut off by a kill;
    CsvLogger drops it on reopen) is left out, so a file another process is
    writing reads as its complete rows. A missing, empty or header-only file
    gives []. A row with more fields than the header raises ValueError naming
    the file and line. For analysis, pandas.read_csv reads the same files.
    """
    try:
        with open(path, "r", newline="", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    if not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = []
    for row in reader:
        if None in row:  # DictReader's restkey: fields beyond the header
            raise ValueError(f"{path}, line {reader.line_num}: {len(reader.fieldnames) + len(row[None])} fields, "
                             f"but the header has {len(reader.fieldnames)}")
        rows.append({key: parse_field(value) for key, value in row.items()})
    return rows
