"""`Seam`: a process-wide implementation made on first use, which tests can replace.

The GPU runtime (`device.runtime()`) and the NCCL library (`nccl.library()`) are each one object
per process, built from CuPy only when something needs it (so a CPU-only process never imports
CuPy), and each must be replaceable by a fake so that the device paths run in CPU tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Seam(Generic[T]):
    """Holds the active implementation: `make()`'s result on first `get`, or a replacement."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._active: T | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        """The active implementation, made now if there is none (once, whatever the threads)."""
        active = self._active
        if active is not None:
            return active
        with self._lock:
            if self._active is None:
                self._active = self._make()
            return self._active

    def replace(self, replacement: T | None) -> T | None:
        """Make `replacement` the active implementation (None: `make()`'s again, on next use);
        returns the one it replaces."""
        with self._lock:
            previous, self._active = self._active, replacement
        return previous
