"""Host collectives through the NCCL transport whose control transport is MPI, in real processes.

    mpiexec -n N python nccl_control.py

NCCL itself is the fake of `tests/fake_nccl.py` (no GPU; it only ever joins ranks of one process,
so nothing here may reach it): what runs is the NCCL transport's use of MPI: the duplicate that
carries envelopes, polled by the progress thread while collectives run, MPI's agreement and
all-reduce for host buffers, a duplicate communicator, a mismatch (the abort through the channel)
and closing. Prints "rank R: ok", then "rank R: mismatch ok".
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from fake_nccl import FakeNccl  # noqa: E402

from collectives import Communicator, MismatchError  # noqa: E402
from collectives.backends.mpi import MPITransport  # noqa: E402
from collectives.backends.nccl import NcclTransport  # noqa: E402


def main() -> int:
    transport = NcclTransport(MPITransport.from_environment(), nccl=FakeNccl(), device_id=0, timeout=30)
    comm = Communicator(transport, timeout=30)
    size = comm.size
    x = np.arange(1000, dtype=np.float64) * (comm.rank + 1)
    expected = np.arange(1000, dtype=np.float64) * size * (size + 1) / 2
    for algorithm in [*comm.algorithms, "auto"]:
        np.testing.assert_array_equal(comm.allreduce(x, algorithm=algorithm), expected, err_msg=algorithm)
    rows = np.arange(4 * size, dtype=np.float32).reshape(2 * size, 2) * (comm.rank + 1)
    np.testing.assert_array_equal(
        comm.reduce_scatter(rows), np.split(rows / (comm.rank + 1) * size * (size + 1) / 2, size)[comm.rank]
    )
    np.testing.assert_array_equal(comm.allgather(np.full(3, comm.rank)), np.repeat(np.arange(size), 3))
    np.testing.assert_array_equal(comm.broadcast(x, root=size - 1), np.arange(1000, dtype=np.float64) * size)
    comm.barrier()
    twin = comm.dup()
    np.testing.assert_array_equal(twin.allreduce(x, algorithm="ring"), expected)
    twin.close()
    print(f"rank {comm.rank}: ok", flush=True)
    try:  # the last rank calls with another shape: every rank is told, and the job still exits cleanly
        comm.allreduce(np.ones(3 if comm.rank == size - 1 else 4), algorithm="ring")
    except MismatchError:
        print(f"rank {comm.rank}: mismatch ok", flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
