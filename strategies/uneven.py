"""All-gather of arrays whose first dimension differs between ranks (Horovod's allgather semantics,
needed for sparse gradients, where every rank touches a different number of embedding rows).

The communicator's `allgather` wants the same shape everywhere, so the row counts are gathered
first, every rank pads its rows to the largest count, and the padding is dropped afterwards.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives import Communicator
from collectives.core.arrays import array_module


def allgather_rows(comm: Communicator, array: Any) -> Any:
    """Concatenate every rank's `array` (numpy, or CuPy on its GPU) along axis 0, in rank order;
    the other axes must agree (a disagreement is a `MismatchError` from the communicator)."""
    xp = array_module(array)
    array = xp.ascontiguousarray(array)
    if array.ndim == 0:
        array = array.reshape(1)
    if comm.size == 1:
        return array.copy()
    counts = comm.allgather(np.array([array.shape[0]], dtype=np.int64))
    longest = int(counts.max())
    padded = xp.zeros((longest, *array.shape[1:]), dtype=array.dtype)
    padded[: array.shape[0]] = array
    gathered = comm.allgather(padded).reshape(comm.size, longest, *array.shape[1:])
    return xp.concatenate([gathered[rank, : int(counts[rank])] for rank in range(comm.size)])
