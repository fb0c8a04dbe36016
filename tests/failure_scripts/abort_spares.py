"""An abort spares the collectives before the failed one, on exactly 2 ranks of a real backend.

    mpiexec -n 2 python abort_spares.py mpi
    python -m collectives.launch -n 2 abort_spares.py grpc

Rank 1 has a receive pending on a tag of an earlier collective (5) and one on the failed
collective's (70) when rank 0 aborts from tag 64 on. Once its tag-70 receive has failed with the
abort (the notice arrived), rank 1 tells rank 0 so on tag 3, another earlier tag, and only then
does rank 0 send its tag-5 message: rank 1's tag-5 receive completes with the data (a slow rank
still finishing `init()` while the others fail their first all-reduce), and a post on tag 64 or
later fails on both ranks. Every rank prints "rank R: abort spares ok" when its checks pass.
"""

from __future__ import annotations

import sys

import numpy as np

from collectives.backends.base import Transport
from collectives.backends.errors import CollectiveError, MismatchError

HEADER = b"communicator setup"
FAILED_FROM = 64
NOTICE_TAKEN = 3
TIMEOUT = 10.0


def transport_of(backend: str) -> Transport:
    if backend == "mpi":
        from mpi4py import MPI

        from collectives.backends.mpi import MPITransport

        return MPITransport(MPI.COMM_WORLD)
    if backend == "grpc":
        from collectives.backends.grpc import GrpcTransport

        return GrpcTransport.from_environment()
    raise ValueError(f"backend must be mpi or grpc, got {backend!r}")


def main(backend: str) -> int:
    transport = transport_of(backend)
    message = np.arange(10, dtype=np.float64)
    signal = np.zeros(1)
    if transport.rank == 0:
        transport.abort(MismatchError("shapes differ"), since_tag=FAILED_FROM)
        transport.irecv(signal, 1, NOTICE_TAKEN, HEADER).wait(TIMEOUT)  # rank 1 has taken the notice in
        transport.isend(message, 1, 5, HEADER).wait(TIMEOUT)
        refused = transport.isend(message, 1, FAILED_FROM, HEADER)
    else:
        earlier = np.zeros(10)
        spared = transport.irecv(earlier, 0, 5, HEADER)
        failed = transport.irecv(np.zeros(10), 0, 70, HEADER)
        try:
            failed.wait(TIMEOUT)
        except MismatchError as error:
            assert "shapes differ" in str(error), error
        else:
            raise AssertionError("the receive of the failed collective completed")
        assert not spared.test(), "the receive of the earlier collective completed before its message was sent"
        transport.isend(signal, 0, NOTICE_TAKEN, HEADER).wait(TIMEOUT)
        spared.wait(TIMEOUT)
        np.testing.assert_array_equal(earlier, message)
        refused = transport.irecv(np.zeros(10), 0, FAILED_FROM + 1, HEADER)
    try:
        refused.wait(TIMEOUT)
    except CollectiveError:
        pass
    else:
        raise AssertionError("an operation of the failed collective was not refused")
    transport.close()
    print(f"rank {transport.rank}: abort spares ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
