"""Fusion buckets: how a model's gradients are packed into a few large all-reduces.

Small all-reduces are latency-bound, so gradients are fused into buckets of about
`bucket_bytes`. Buckets are filled in reverse variable order, the order in which backprop produces
gradients (last layer first, as PyTorch DDP does), so the first bucket is complete early and its
all-reduce runs while backprop continues. A bucket holds one dtype; a gradient larger than the
bucket size gets a bucket of its own. Each gradient starts at a 64-byte boundary of its bucket, so
that its share of the result can become a tensor without a copy. The plan depends only on the
variables' shapes and dtypes, so every rank computes the same one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._tensorflow import ALIGNMENT

DEFAULT_BUCKET_BYTES = 4 << 20
"""Large enough that per-collective latency is a small share, small enough that the first bucket
is ready early in backprop."""


@dataclass(frozen=True)
class Slot:
    """Where one gradient lives in its bucket."""

    variable: int
    """Index of the variable in the list the plan was made for."""
    offset: int
    """First element in the bucket."""
    shape: tuple[int, ...]

    @property
    def count(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    """Gradients of one dtype, all-reduced as one flat buffer."""

    dtype: np.dtype
    slots: tuple[Slot, ...]

    @property
    def count(self) -> int:
        last = self.slots[-1]
        return last.offset + last.count

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def plan_buckets(
    specs: Sequence[tuple[tuple[int, ...], np.dtype] | None], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> tuple[Bucket, ...]:
    """Pack the gradients described by `specs` (shape and dtype per variable, in variable order;
    None for a variable left out, e.g. one with a sparse gradient) into buckets.

    Raises:
        ValueError: `bucket_bytes` is not positive.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups: list[tuple[np.dtype, list[Slot]]] = []  # (dtype, slots) of each bucket, the last one open
    filled = 0
    for variable in reversed(range(len(specs))):
        spec = specs[variable]
        if spec is None:
            continue
        shape, dtype = tuple(int(d) for d in spec[0]), np.dtype(spec[1])
        nbytes = math.prod(shape) * dtype.itemsize
        filled = -(-filled // ALIGNMENT) * ALIGNMENT
        if not groups or dtype != groups[-1][0] or filled + nbytes > bucket_bytes:
            groups.append((dtype, []))
            filled = 0
        groups[-1][1].append(Slot(variable, filled // dtype.itemsize, shape))
        filled += nbytes
    return tuple(Bucket(dtype, tuple(slots)) for dtype, slots in groups)
