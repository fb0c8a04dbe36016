"""Inputs whose collective result is known exactly, so `#wrong` is a real correctness check.

Every value is a small integer, exact in every dtype, and every partial result an algorithm can form
on the way is exact too (sums of small integers, products that are a single non-one factor per
element), so the result does not depend on the order the algorithm reduces in and any difference
from the expected array is a bug, not rounding. `mean` divides an exact sum once, as the library
does, so its expected value is that same single rounding; a float16 mean divides every input first
(`collectives.core.ops.divided_first`), so its inputs are multiples of the rank count, and every
division and the result are exact.

Sizes follow nccl-tests: for reduce_scatter and allgather `count` is the element count of the large
buffer (the input of reduce_scatter, the output of allgather), a multiple of the rank count.
"""

from __future__ import annotations

import numpy as np

from collectives.core.ops import ReduceOp

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")
REDUCING = ("allreduce", "reduce_scatter")
"""The collectives that take an op; the others move data only."""


def _base(count: int, start: int = 0) -> np.ndarray:
    """1..7 repeating: different on neighbouring elements, so a shifted block is caught."""
    return np.arange(start, start + count) % 7 + 1


def input_count(collective: str, count: int, size: int) -> int:
    """Elements of each rank's input buffer for a collective whose large buffer has `count`."""
    return count // size if collective == "allgather" else count


def output_count(collective: str, count: int, size: int) -> int:
    """Elements of each rank's output buffer."""
    return count // size if collective == "reduce_scatter" else count


def make_input(collective: str, op: ReduceOp, rank: int, size: int, count: int, dtype: np.dtype) -> np.ndarray:
    """This rank's input (for allgather the element offset continues across ranks' blocks)."""
    if collective == "allgather":
        n = count // size
        return (_base(n, rank * n) * (rank + 1)).astype(dtype)
    if collective in REDUCING and op is ReduceOp.PROD:
        owned = np.arange(count) % size == rank
        return np.where(owned, _base(count), 1).astype(dtype)
    return (_base(count) * (rank + 1) * _divided_first(collective, op, size, dtype)).astype(dtype)


def _divided_first(collective: str, op: ReduceOp, size: int, dtype: np.dtype) -> int:
    """What the inputs are multiplied by so that a mean that divides each one first stays exact."""
    return size if collective in REDUCING and op is ReduceOp.MEAN and np.dtype(dtype) == np.float16 else 1


def expected_output(
    collective: str, op: ReduceOp, rank: int, size: int, count: int, dtype: np.dtype, root: int = 0
) -> np.ndarray:
    """The exact result this rank must hold after the collective."""
    dtype = np.dtype(dtype)
    if collective == "broadcast":
        return (_base(count) * (root + 1)).astype(dtype)
    if collective == "allgather":
        n = count // size
        return np.concatenate([_base(n, r * n) * (r + 1) for r in range(size)]).astype(dtype)
    base = _base(count)
    if op is ReduceOp.PROD or op is ReduceOp.MIN:
        full = base.astype(dtype)
    elif op is ReduceOp.MAX:
        full = (base * size).astype(dtype)
    else:
        full = (base * (size * (size + 1) // 2)).astype(dtype)
        if op is ReduceOp.MEAN and _divided_first(collective, op, size, dtype) == 1:
            full = np.divide(full, size, dtype=dtype)
    if collective == "reduce_scatter":
        n = count // size
        return full[rank * n : (rank + 1) * n]
    return full


def check_exact(collective: str, op: ReduceOp, size: int, dtype: np.dtype) -> None:
    """Raise ValueError where the payload would not be exact (float16 sums on many ranks)."""
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        return
    largest = 7 * (size * (size + 1) // 2 if collective in REDUCING and op in (ReduceOp.SUM, ReduceOp.MEAN) else size)
    largest = max(largest, 7 * size * _divided_first(collective, op, size, dtype))  # the largest input
    exact_up_to = 2 ** (np.finfo(dtype).nmant + 1)
    if largest > exact_up_to:
        raise ValueError(
            f"{collective} {op.value} on {size} ranks in {dtype} reaches {largest}, beyond the "
            f"{exact_up_to} up to which {dtype} holds every integer, so results could not be checked "
            f"exactly; use a wider dtype or fewer ranks"
        )
