"""The `raw` row: the MPI library's own all-reduce called straight through mpi4py, beside ours.

On `--backend mpi` every size gets a row timed exactly like the library's (same buffers, same
barrier before each call, slowest rank, median), where each rank calls `MPI_Allreduce` on a
duplicate of `MPI.COMM_WORLD` with no library code around it. Its time is the floor any all-reduce
through the library can reach; `native` (the same MPI call through a `Communicator`) against
`raw` is the library's per-call overhead, and `auto` against `raw` is what a user pays or gains
for using the library instead of mpi4py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

RAW = "raw"
"""The row's name, given with -a like an algorithm."""

RAW_OPS = ("sum", "max", "min", "prod")
RAW_DTYPES = ("float32", "float64", "int32", "int64")
"""What mpi4py maps onto MPI by itself (no mean; float16 only where MPI has it)."""

_engine: Any = None


def raw_allreduce(op: str) -> Callable[[np.ndarray, np.ndarray], None]:
    """out = op over all ranks of src by MPI_Allreduce (in place when out is src)."""
    global _engine
    from mpi4py import MPI

    if _engine is None:
        _engine = MPI.COMM_WORLD.Dup()
    engine = _engine
    mpi_op = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[op]

    def run(src: np.ndarray, out: np.ndarray) -> None:
        engine.Allreduce(MPI.IN_PLACE if src is out else src, out, op=mpi_op)

    return run


def raw_row_fits(backend: str, collective: str, op: str, dtype: str) -> bool:
    """Whether a sweep gets a `raw` row by default: an MPI all-reduce mpi4py can do as it is."""
    return backend == "mpi" and collective == "allreduce" and op in RAW_OPS and dtype in RAW_DTYPES
