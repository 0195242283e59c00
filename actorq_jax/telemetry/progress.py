"""A single live status line that does not flood non-terminal logs."""

from __future__ import annotations

import shutil
import sys
import time
from typing import Callable, Optional, TextIO

_TTY_INTERVAL_S = 0.1
_LOG_INTERVAL_S = 30.0


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is a terminal (False for files, pipes, closed streams and objects without isatty)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class ProgressLine:
    """Shows the latest status text, throttled.

    On a terminal the line is rewritten in place ("\\r" + text + clear to end
    of line), at most once per `min_interval_s` (default 0.1 s), cut to the
    terminal width so it never wraps. On anything else (a log file, a pipe,
    io.StringIO) each shown update is a full line, at most once per
    `min_interval_s` (default 30 s). The first update is shown at once;
    updates in between replace each other and the latest one is shown by
    close() if it was not shown yet. `clock` is injectable for tests.
    """

    def __init__(
        self,
        stream: Optional[TextIO] = None,
        min_interval_s: Optional[float] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._stream = sys.stderr if stream is None else stream
        self._tty = is_terminal(self._stream)
        if min_interval_s is None:
            min_interval_s = _TTY_INTERVAL_S if self._tty else _LOG_INTERVAL_S
        min_interval_s = float(min_interval_s)
        if not min_interval_s >= 0.0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s!r}")
        self._interval = min_interval_s
        self._clock = clock
        self._last_shown_at = -float("inf")
        self._pending: Optional[str] = None
        self._shown_any = False
        self._closed = False

    @property
    def is_tty(self) -> bool:
        """Whether the stream is a terminal (in-place rewriting)."""
        return self._tty

    def update(self, text: str, force: bool = False) -> bool:
        """Sets the status text; returns whether it was written now."""
        if self._closed:
            raise RuntimeError("ProgressLine is closed")
        # One physical line: embedded newlines would break in-place rewriting.
        text = " ".join(str(text).splitlines())
        now = self._clock()
        if not force and now - self._last_shown_at < self._interval:
            self._pending = text
            return False
        self._show(text)
        self._last_shown_at = now
        return True

    def _show(self, text: str) -> None:
        if self._tty:
            width = shutil.get_terminal_size((80, 24)).columns
            self._stream.write("\r" + text[: max(width - 1, 1)] + "\x1b[K")
        else:
            self._stream.write(text + "\n")
        self._stream.flush()
        self._pending = None
        self._shown_any = True

    def close(self) -> None:
        """Shows the latest text if it was held back and ends the line (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._pending is not None:
            self._show(self._pending)
        if self._tty and self._shown_any:
            self._stream.write("\n")
            self._stream.flush()

    def __enter__(self) -> "ProgressLine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
