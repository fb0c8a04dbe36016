"""A closing note (`MPITransport.leaving`) fails only what its sender will never do, and ranks that
close together free their communicators; exactly 2 ranks.

    mpiexec -n 2 python closing_notes.py

Rank 1 sends a message on tag 5 (a collective it completed), says it leaves from tag 64 on and
closes. Rank 0 then posts a receive on tag 70: it fails with `PeerLostError` naming rank 1, long
before its timeout, and only then receives the tag-5 message, whose data must be whole. Afterwards
both ranks close a duplicate transport at the same time: both must free its communicator (nothing
added to the transports MPI keeps for good). Every rank prints "rank R: closing notes ok".
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from collectives.backends import mpi
from collectives.backends.errors import PeerLostError

HEADER = b"earlier collective"
LEAVES_FROM = 64
TIMEOUT = 30.0


def main() -> int:
    transport = mpi.MPITransport(MPI.COMM_WORLD)
    spare = transport.dup(1)
    message = np.arange(10, dtype=np.float64)
    if transport.rank == 1:
        transport.isend(message, 0, 5, HEADER).wait(TIMEOUT)
        transport.leaving(LEAVES_FROM)
        transport.close()
    else:
        started = time.monotonic()
        try:
            transport.irecv(np.zeros(10), 1, LEAVES_FROM + 6, HEADER).wait(TIMEOUT)
        except PeerLostError as error:
            assert "peer rank 1 closed its communicator" in str(error), error
        else:
            raise AssertionError("a receive rank 1 will never send to completed")
        assert time.monotonic() - started < TIMEOUT / 2, "the closing note was not taken in promptly"
        earlier = np.zeros(10)
        transport.irecv(earlier, 1, 5, HEADER).wait(TIMEOUT)
        np.testing.assert_array_equal(earlier, message)
        transport.close()
    MPI.COMM_WORLD.Barrier()
    kept = len(mpi._LEAKED)
    spare.leaving(LEAVES_FROM)
    spare.close()
    assert len(mpi._LEAKED) == kept, f"rank {spare.rank}: closing together kept the communicator"
    print(f"rank {transport.rank}: closing notes ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
