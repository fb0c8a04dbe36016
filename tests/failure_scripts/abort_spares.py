"""An abort spares the collectives before the failed one, over MPI, on exactly 2 ranks.

    mpiexec -n 2 python abort_spares.py

Rank 1 has a receive pending on a tag of an earlier collective (5) and one on the failed
collective's (70) when rank 0 aborts from tag 64 on and only then sends its tag-5 message: rank 1's
tag-70 receive fails with the abort, its tag-5 receive completes with the data (a slow rank still
finishing `init()` while the others fail their first all-reduce), a new tag-5 post still works and
one on tag 64 fails. Every rank prints "rank R: abort spares ok" when its checks pass.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from collectives.backends.errors import CollectiveError, MismatchError
from collectives.backends.mpi import MPITransport

HEADER = b"communicator setup"
FAILED_FROM = 64


def main() -> int:
    transport = MPITransport(MPI.COMM_WORLD)
    message = np.arange(10, dtype=np.float64)
    if transport.rank == 0:
        transport.abort(MismatchError("shapes differ"), since_tag=FAILED_FROM)
        MPI.COMM_WORLD.Barrier()  # rank 1 has taken the notice in
        transport.isend(message, 1, 5, HEADER).wait(10)
        refused = transport.isend(message, 1, FAILED_FROM, HEADER)
    else:
        earlier = np.zeros(10)
        spared = transport.irecv(earlier, 0, 5, HEADER)
        failed = transport.irecv(np.zeros(10), 0, 70, HEADER)
        try:
            failed.wait(10)
        except MismatchError as error:
            assert "shapes differ" in str(error), error
        else:
            raise AssertionError("the receive of the failed collective completed")
        MPI.COMM_WORLD.Barrier()
        spared.wait(10)
        np.testing.assert_array_equal(earlier, message)
        refused = transport.irecv(np.zeros(10), 0, FAILED_FROM + 1, HEADER)
    try:
        refused.wait(10)
    except CollectiveError:
        pass
    else:
        raise AssertionError("an operation of the failed collective was not refused")
    transport.close()
    print(f"rank {transport.rank}: abort spares ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
