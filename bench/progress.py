"""A one-line progress bar on stderr, for sweeps that take minutes.

It draws only when its stream is a terminal: redirected to a file or a pipe (a CI log, the launcher
collecting a rank's output) a bar would be noise made of carriage returns. No dependency: it is a
counter and a redraw.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 30


class ProgressBar:
    """`[#####.....]  12/40  4194304 B ring in-place` redrawn in place; `close()` clears it."""

    def __init__(self, total: int, stream: TextIO | None = None, *, enabled: bool | None = None) -> None:
        self.total = max(total, 1)
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0
        self._last_draw = 0.0

    def advance(self, label: str = "") -> None:
        """Count one step done; redraw at most 10 times a second (and always on the last step)."""
        self.done += 1
        now = time.monotonic()
        if not self.enabled or (now - self._last_draw < 0.1 and self.done < self.total):
            return
        self._last_draw = now
        filled = _WIDTH * min(self.done, self.total) // self.total
        line = f"[{'#' * filled}{'.' * (_WIDTH - filled)}] {self.done:>4}/{self.total}  {label}"
        self.stream.write("\r" + line[:100].ljust(100))
        self.stream.flush()

    def close(self) -> None:
        """Erase the bar so the next output starts on a clean line."""
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
