"""`Group`: what an algorithm sees of the transport during one collective.

A group is an ordered set of ranks (the whole world, or a sub-group such as "the ranks of my node"
for hierarchical algorithms) plus everything one collective needs to talk safely: its tag block,
the header every message carries (so mismatched calls are detected) and its deadline. Algorithms
address peers by their index in the group and never see global ranks, tags or clocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from backends.base import Request, Transport
from backends.errors import CollectiveTimeoutError

SUBTAGS_PER_COLLECTIVE = 64
"""Each collective owns this many consecutive tags, so concurrent message streams never mix."""


@dataclass(frozen=True)
class Pending:
    """A posted send or receive, with what is needed to explain a timeout."""

    request: Request
    kind: str
    peer: int
    tag: int


@dataclass(frozen=True)
class Group:
    """A view of the transport restricted to `members`, for one collective."""

    transport: Transport
    members: tuple[int, ...]
    """Global ranks, in group order."""
    tag: int
    header: bytes
    deadline: float
    """`time.monotonic()` value after which waiting is an error."""
    timeout: float
    """The collective's full timeout in seconds, quoted in error messages."""

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        """This process's index in the group."""
        return self.members.index(self.transport.rank)

    def subgroup(self, indices: Sequence[int], subtag: int) -> "Group":
        """The sub-group of the given member indices, talking on its own tag."""
        if not 0 <= subtag < SUBTAGS_PER_COLLECTIVE:
            raise ValueError(f"subtag {subtag} outside 0..{SUBTAGS_PER_COLLECTIVE - 1}")
        return Group(
            self.transport,
            tuple(self.members[i] for i in indices),
            self.tag + subtag,
            self.header,
            self.deadline,
            self.timeout,
        )

    def isend(self, buf: np.ndarray, peer: int, subtag: int = 0) -> Pending:
        """Start sending `buf` to group member `peer`."""
        tag = self.tag + subtag
        dst = self.members[peer]
        return Pending(self.transport.isend(buf, dst, tag, self.header), "send to", dst, tag)

    def irecv(self, buf: np.ndarray, peer: int, subtag: int = 0) -> Pending:
        """Start receiving from group member `peer` into `buf`."""
        tag = self.tag + subtag
        src = self.members[peer]
        return Pending(self.transport.irecv(buf, src, tag, self.header), "receive from", src, tag)

    def wait(self, pending: Pending) -> None:
        """Wait for one operation until the collective's deadline."""
        remaining = self.deadline - time.monotonic()
        try:
            pending.request.wait(max(remaining, 0.0))
        except TimeoutError:
            me = self.transport.rank
            raise CollectiveTimeoutError(
                f"rank {me}: {pending.kind} rank {pending.peer} did not complete within "
                f"{self.timeout:g} s (tag {pending.tag}, {self.header.decode(errors='replace')}); "
                f"rank {pending.peer} never arrived at this collective, or is stuck or dead",
                rank=me,
                peer=pending.peer,
                tag=pending.tag,
                seconds=self.timeout,
            ) from None

    def waitall(self, pendings: Iterable[Pending]) -> None:
        """Wait for every operation, in order, until the collective's deadline."""
        for pending in pendings:
            self.wait(pending)
