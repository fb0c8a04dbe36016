"""`join()`: training on uneven data, as Horovod's `hvd.join()`.

A rank that has run out of batches calls `join()`. Until every rank has joined, it keeps answering
the all-reduces the others still run (the `DistributedGradientTape`'s buckets, `allreduce`,
`grouped_allreduce`) with a contribution that changes nothing; then every rank returns from
`join()` the rank that joined last.

A joined rank cannot guess what the others will call next, so the others tell it: every
join-aware collective is preceded by an announcement, a small all-gather of one fixed-size record
per rank. A rank still training announces what it is about to run (all-reduce, dtype, element
count, op, algorithm); a joined rank announces that it has joined. So each announcement also tells
the ranks still training, at every step, which ranks have joined, and tells a joined rank what to
answer:

    rank 0 (training)   announce allreduce f32 x 1000 sum  ->  allreduce(gradients)
    rank 1 (joined)     announce joined                    ->  allreduce(zeros(1000, f32), sum)
    ...
    once every record says "joined": every joined rank returns the last rank to join

What a joined rank contributes is the identity of the op: zeros for sum and mean, ones for prod, the
lowest and highest value for max and min, so that those three give the result of the ranks with
data. As in Horovod, "mean" still divides by the full number of ranks, not by the number of ranks
that had data: the learning rate of a step with fewer ranks is in effect scaled down by the
fraction that trained.

The first-step fingerprint of the gradient tape (`fingerprint.check_same_everywhere`) travels in an
announcement too: a joined rank has no variables to compare, so the ranks compare only theirs.

While some rank has joined, the others may call only join-aware collectives and `join()`; anything
else (a broadcast, the all-gather of sparse gradients) meets the joined rank's announcement and
fails with `MismatchError` on every rank instead of hanging. Outside `join()` an announcement costs
one small all-gather before each join-aware collective.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives import Communicator, MismatchError, Work
from collectives.core.ops import REDUCTION_DTYPES, ReduceOp, check_reduction

from ._tensorflow import communicator

_ACTIVE, _JOINED = 1, 2
_ALLREDUCE, _CHECK = 1, 2
_OPS = tuple(ReduceOp)
_DIGEST_WORDS = 4
"""int64 words of a fingerprint digest (32 bytes) carried by a check's announcement."""

_STATE, _FRESH, _KIND, _DTYPE, _COUNT, _OP, _ALGORITHM, _DIGEST = 0, 1, 2, 3, 4, 5, 6, 7
_RECORD_WORDS = _DIGEST + _DIGEST_WORDS
"""An announcement: state, fresh (a joined rank's first announcement), kind, dtype, count, op,
algorithm, digest; int64 words."""


def join(comm: Communicator | None = None) -> int:
    """Answer the other ranks' join-aware collectives until every rank has called `join()`.

    Called eagerly, from the training loop (not inside a `tf.function`); afterwards the ranks may
    train on (a new epoch) or, as with Horovod, broadcast the variables of the rank returned.

    Returns:
        The rank that joined last (the highest of those that joined in the same round), the same
        on every rank.

    Raises:
        MismatchError: the ranks still training announced different collectives, or one of them
            called a collective that is not join-aware.
    """
    comm = communicator(comm)
    if comm.size == 1:
        return comm.rank
    record = np.zeros(_RECORD_WORDS, dtype=np.int64)
    record[_STATE], record[_FRESH] = _JOINED, 1
    while True:
        records = _announce(comm, record)
        record[_FRESH] = 0
        training = np.flatnonzero(records[:, _STATE] == _ACTIVE)
        if training.size == 0:
            return int(np.flatnonzero(records[:, _FRESH])[-1])
        plan = _agreed_plan(comm, records, training)
        if plan[_KIND] == _ALLREDUCE:
            op = _OPS[plan[_OP]]
            dtype = REDUCTION_DTYPES[plan[_DTYPE]]
            algorithm = "auto" if plan[_ALGORITHM] == 0 else comm.algorithms[plan[_ALGORITHM] - 1]
            comm.allreduce(np.full(int(plan[_COUNT]), _identity(op, dtype), dtype=dtype), op, algorithm)


def announced_allreduce(
    comm: Communicator, array: np.ndarray, op: str | ReduceOp = "sum", algorithm: str = "auto", out: Any = None
) -> np.ndarray:
    """`comm.allreduce(array, op, algorithm, out)`, which ranks that have joined answer."""
    if comm.size == 1:
        return comm.allreduce(array, op, algorithm, out)
    flat = np.ascontiguousarray(array).reshape(-1)
    _announce(comm, _allreduce_record(comm, flat, op, algorithm))
    reduced = comm.allreduce(flat, op, algorithm, None if out is None else out.reshape(-1))
    return reduced.reshape(np.shape(array)) if out is None else out


def announced_allreduce_async(
    comm: Communicator, flat: np.ndarray, op: str | ReduceOp = "sum", out: np.ndarray | None = None
) -> Work:
    """`comm.allreduce_async(flat, op, out=out)` of a 1-D array, which ranks that have joined answer."""
    if comm.size > 1:
        comm.allgather_async(_allreduce_record(comm, flat, op, "auto"))
    return comm.allreduce_async(flat, op, out=out)


def announced_digests(comm: Communicator, digest: bytes) -> np.ndarray:
    """Every rank's 32-byte `digest` (rows of uint8, in rank order), rows of joined ranks left out."""
    if len(digest) != 8 * _DIGEST_WORDS:
        raise ValueError(f"a digest has {8 * _DIGEST_WORDS} bytes, got {len(digest)}")
    record = np.zeros(_RECORD_WORDS, dtype=np.int64)
    record[_STATE], record[_KIND] = _ACTIVE, _CHECK
    record[_DIGEST:] = np.frombuffer(digest, dtype=np.int64)
    records = _announce(comm, record)
    training = records[records[:, _STATE] == _ACTIVE]
    return np.ascontiguousarray(training[:, _DIGEST:]).view(np.uint8)


def _allreduce_record(comm: Communicator, flat: np.ndarray, op: str | ReduceOp, algorithm: str) -> np.ndarray:
    """The announcement of an all-reduce; checks what a joined rank must be able to repeat first, so
    that bad arguments fail before anything is sent."""
    op = ReduceOp.parse(op)
    check_reduction(op, flat.dtype)
    if algorithm != "auto" and algorithm not in comm.algorithms:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; expected 'auto' or one of {comm.algorithms}")
    record = np.zeros(_RECORD_WORDS, dtype=np.int64)
    record[_STATE], record[_KIND] = _ACTIVE, _ALLREDUCE
    record[_DTYPE] = REDUCTION_DTYPES.index(flat.dtype)
    record[_COUNT] = flat.size
    record[_OP] = _OPS.index(op)
    record[_ALGORITHM] = 0 if algorithm == "auto" else comm.algorithms.index(algorithm) + 1
    return record


def _announce(comm: Communicator, record: np.ndarray) -> np.ndarray:
    """Every rank's record, one row per rank."""
    return comm.allgather(record).reshape(comm.size, _RECORD_WORDS)


def _agreed_plan(comm: Communicator, records: np.ndarray, training: np.ndarray) -> np.ndarray:
    """The collective the ranks still training announced; a MismatchError if they disagree."""
    first = training[0]
    for other in training[1:]:
        if not np.array_equal(records[other, _KIND:_DIGEST], records[first, _KIND:_DIGEST]):
            raise MismatchError(
                f"rank {comm.rank} (joined): ranks {first} and {other} announced different collectives: "
                f"{_describe(records[first])} and {_describe(records[other])}"
            )
    return records[first]


def _describe(record: np.ndarray) -> str:
    if record[_KIND] == _CHECK:
        return "a variable fingerprint check"
    return (
        f"all-reduce of {record[_COUNT]} {REDUCTION_DTYPES[record[_DTYPE]]} "
        f"op={_OPS[record[_OP]].value} algorithm code {record[_ALGORITHM]}"
    )


def _identity(op: ReduceOp, dtype: np.dtype) -> Any:
    """The value that leaves `op`'s result unchanged: what a joined rank contributes."""
    if op is ReduceOp.PROD:
        return 1
    if op in (ReduceOp.MAX, ReduceOp.MIN):
        limits = np.finfo(dtype) if dtype.kind == "f" else np.iinfo(dtype)
        return limits.min if op is ReduceOp.MAX else limits.max
    return 0
