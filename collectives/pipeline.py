"""`ReceiveStream`: receive a known sequence of segments from one peer into rotating scratch slots.

Reduction steps cannot receive straight into the result (the local contribution is still needed),
so they receive into scratch. Keeping a few receives posted ahead lets the peer's sends complete
without waiting for us, while the scratch stays a few segments large (and in cache) whatever the
message size.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

from .group import Group, Pending

PIPELINE_DEPTH = 4
"""Receives kept posted ahead of the one being consumed."""


class ReceiveStream:
    """Receives `sizes[i]` items for i = 0, 1, ... from group member `peer`, in order."""

    def __init__(
        self, group: Group, peer: int, subtag: int, sizes: Sequence[int], dtype: np.dtype
    ) -> None:
        self._group = group
        self._peer = peer
        self._subtag = subtag
        self._sizes = list(sizes)
        self._depth = min(PIPELINE_DEPTH, len(self._sizes))
        self._slots = np.empty((self._depth, max(self._sizes, default=0)), dtype=dtype)
        self._posted: deque[tuple[Pending, np.ndarray]] = deque()
        self._next_to_post = 0
        self._slot_in_use = False
        for _ in range(self._depth):
            self._post()

    def _post(self) -> None:
        index = self._next_to_post
        if index >= len(self._sizes):
            return
        slot = self._slots[index % self._depth, : self._sizes[index]]
        self._posted.append((self._group.irecv(slot, self._peer, self._subtag), slot))
        self._next_to_post += 1

    def next(self) -> np.ndarray:
        """Wait for the next segment and return it; valid until the following call."""
        if self._slot_in_use:
            self._post()  # the slot handed out last time is free again
        self._slot_in_use = True
        pending, slot = self._posted.popleft()
        self._group.wait(pending)
        return slot
