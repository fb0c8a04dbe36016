"""The first-step check that every rank trains the same variables, in the same order.

Without it a rank with a different model (another layer, another shape, variables created in
another order) pairs its buckets with the wrong gradients of its peers, or waits for a bucket
that never comes. Every rank hashes a description of its variables (name, shape, dtype, in
order); the 32-byte digests are all-gathered, and only when they differ are the full
descriptions exchanged, so that every rank raises the same `MismatchError` naming the first
entry that differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from collectives import Communicator
from collectives.backends.errors import MismatchError

from .joining import announced_digests
from .uneven import allgather_rows


def describe(name: str, shape: Sequence[int | None], dtype: str) -> str:
    """One entry of the fingerprint."""
    return f"{name} {tuple(shape)} {dtype}"


def check_same_everywhere(comm: Communicator, entries: Sequence[str], what: str = "variables") -> None:
    """Raise `MismatchError` on every rank unless all ranks passed the same `entries`.

    Raises:
        MismatchError: naming the first differing entry, its index and the ranks involved.
    """
    if comm.size == 1:
        return
    text = "\n".join(entries).encode()
    digests = announced_digests(comm, hashlib.sha256(text).digest())  # ranks that have joined compare nothing
    if (digests == digests[0]).all():
        return
    lengths = comm.allgather(np.array([len(text)], dtype=np.int64))
    texts = allgather_rows(comm, np.frombuffer(text, dtype=np.uint8))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    lists = [bytes(texts[bounds[r] : bounds[r + 1]]).decode().split("\n") for r in range(comm.size)]
    other = next(r for r in range(1, comm.size) if lists[r] != lists[0])
    raise MismatchError(
        f"rank {comm.rank}: the ranks disagree on their {what}: {_first_difference(lists[0], lists[other], other)}"
    )


def _first_difference(reference: list[str], other: list[str], rank: int) -> str:
    for index, (mine, theirs) in enumerate(zip(reference, other)):
        if mine != theirs:
            return f"entry {index} is {mine!r} on rank 0 but {theirs!r} on rank {rank}"
    shorter, longer, who = (other, reference, 0) if len(other) < len(reference) else (reference, other, rank)
    return (
        f"rank 0 has {len(reference)} and rank {rank} has {len(other)}; "
        f"entry {len(shorter)} ({longer[len(shorter)]!r}) exists only on rank {who}"
    )
