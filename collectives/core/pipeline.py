"""`ReduceStream`: receive a known sequence of segments from one peer and reduce each into place.

A reduction step needs the incoming segment and the local contribution together. Where the
transport can hand over the incoming message directly (`Transport.irecv_reduce`), the reduction
reads it once from where it arrives; otherwise segments land in a few rotating scratch slots and are
reduced from there. Either way a few receives stay posted ahead of the one being consumed, so the
peer's sends complete without waiting for us and the scratch stays small (and in cache).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from collectives.core.arrays import scratch
from collectives.core.group import Group, Pending
from collectives.core.schedule import Steps, wait

PIPELINE_DEPTH = 4
"""Receives kept posted ahead of the one being consumed."""

ReduceSegment = Callable[[int, int, np.ndarray], None]
"""reduce_segment(lo, hi, incoming): fold `incoming` into the result's items [lo, hi)."""


class ReduceStream:
    """Receives `spans[i]` = (lo, hi) for i = 0, 1, ... from group member `peer` on `tag`, in order.

    Args:
        target: the array the spans index; gives the size and dtype of each message.
        reduce_segment: applied to every segment. With `fuse=True` it may run on another thread
            as soon as the segment arrives, so it must not depend on the order of segments; with
            `fuse=False` it runs inside `next_segment()`, in order.
    """

    def __init__(
        self,
        group: Group,
        peer: int,
        tag: int,
        spans: Sequence[tuple[int, int]],
        target: np.ndarray,
        reduce_segment: ReduceSegment,
        *,
        fuse: bool,
    ) -> None:
        self._group = group
        self._peer = peer
        self._tag = tag
        self._spans = list(spans)
        self._target = target
        self._reduce_segment = reduce_segment
        self._fused = fuse and group.fuses_receive_reduce
        self._depth = min(PIPELINE_DEPTH, len(self._spans))
        longest = max((hi - lo for lo, hi in self._spans), default=0)
        # Where the target lives: from the transport for host buffers, like any buffer it
        # receives into (on the simulated backend's timing-only runs that costs no memory); on
        # the target's device for a device array.
        self._slots: Any = (
            None  # unused: segments are reduced where they arrive
            if self._fused
            else scratch(group.transport, self._depth * longest, target).reshape(self._depth, longest)
        )
        self._posted: deque[tuple[Pending, int, int, np.ndarray | None]] = deque()
        self._next_to_post = 0
        self._slot_in_use = False
        for _ in range(self._depth):
            self._post()

    def _post(self) -> None:
        index = self._next_to_post
        if index >= len(self._spans):
            return
        lo, hi = self._spans[index]
        if self._fused:
            consume = functools.partial(self._reduce_segment, lo, hi)
            pending = self._group.irecv_reduce(self._target[lo:hi], self._peer, consume, self._tag)
            self._posted.append((pending, lo, hi, None))
        else:
            slot = self._slots[index % self._depth, : hi - lo]
            self._posted.append((self._group.irecv(slot, self._peer, self._tag), lo, hi, slot))
        self._next_to_post += 1

    def next_segment(self) -> Steps:
        """The step (NCCL's recvReduce): wait for the next segment, then reduce it into place."""
        if self._slot_in_use:
            self._post()  # the scratch slot consumed last time is free again
        self._slot_in_use = True
        pending, lo, hi, slot = self._posted.popleft()
        yield wait(pending)
        if slot is not None:
            self._reduce_segment(lo, hi, slot)
