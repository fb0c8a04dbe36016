"""The last rank arrives at a collective after the others' timeout, but nobody dies.

    mpiexec -n 3 python slow_peer.py

The first punctual rank to time out raises CollectiveTimeoutError, the others (the late one
included) PeerLostError through its abort notice; each prints "rank R: raised NAME" and the job
exits 0: the MPI backend ends a job itself
(MPI_Abort at exit) only when a peer really is gone, which here it is not.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from collectives import CollectiveError, CollectiveTimeoutError, Communicator, PeerLostError
from collectives.backends.mpi import MPITransport

TIMEOUT = 1.0


def main() -> int:
    comm = Communicator(MPITransport.from_environment(), timeout=TIMEOUT)
    comm.allreduce(np.ones(10))
    late = comm.rank == comm.size - 1
    if late:
        time.sleep(2.5 * TIMEOUT)
    try:
        comm.allreduce(np.ones(100_000, np.float32))
    except CollectiveError as error:
        expected = PeerLostError if late else (CollectiveTimeoutError, PeerLostError)
        assert isinstance(error, expected), f"rank {comm.rank}: {error!r}"
        print(f"rank {comm.rank}: raised {type(error).__name__}", flush=True)
    else:
        raise AssertionError(f"rank {comm.rank}: no error")
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
