"""The benchmark's `raw-agreed` row under mpiexec: it agrees on the header before MPI's all-reduce.

    mpiexec -n 2 python raw_agreed_check.py

Ranks that pass arrays of different sizes each raise MismatchError from the agreement, before
MPI_Allreduce (which would be given mismatched counts) is called; the ranks then agree on a
matching call, whose result is the exact sum. Each rank prints "rank R: mismatch refused" and
"rank R: sum exact".
"""

from __future__ import annotations

import sys

import numpy as np

from collectives import Communicator, MismatchError
from collectives.backends.mpi import MPITransport
from collectives.bench.raw import raw_agreed_allreduce


def main() -> int:
    comm = Communicator(MPITransport.from_environment(), timeout=30.0)
    allreduce = raw_agreed_allreduce(comm, "sum")
    count = 1024 if comm.rank == 0 else 512
    try:
        allreduce(np.ones(count, np.float32), np.empty(count, np.float32))
    except MismatchError as error:
        print(f"rank {comm.rank}: mismatch refused ({error})", flush=True)
    src = np.arange(1000, dtype=np.float64) * (comm.rank + 1)
    out = np.empty_like(src)
    allreduce(src, out)
    expected = np.arange(1000, dtype=np.float64) * sum(range(1, comm.size + 1))
    if np.array_equal(out, expected):
        print(f"rank {comm.rank}: sum exact", flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
