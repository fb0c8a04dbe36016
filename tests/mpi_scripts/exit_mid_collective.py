"""A rank whose program ends while an asynchronous collective runs: its peers fail at once, told
why, not at their deadline; exactly 2 ranks.

    mpiexec -n 2 python exit_mid_collective.py

Rank 0 starts an all-reduce that rank 1 joins only a second later, and its program ends (without
waiting for the `Work`). Rank 1's all-reduce must fail with `PeerLostError` naming rank 0 and
saying it exited in the middle of a collective, long before the 30 s timeout (before, it waited
all of it). Rank 1 prints "rank 1: exit mid-collective ok"; rank 0 prints "rank 0: exit
mid-collective ok" as it leaves.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import collectives
from collectives import PeerLostError

TIMEOUT = 30.0


def main() -> int:
    comm = collectives.init(backend="mpi", timeout=TIMEOUT)
    x = np.ones(1 << 16, np.float32)
    comm.allreduce(x)
    if comm.rank == 0:
        comm.allreduce_async(x)  # never waited for
        print("rank 0: exit mid-collective ok", flush=True)
        return 0
    time.sleep(1.0)
    started = time.monotonic()
    try:
        comm.allreduce(x)
    except PeerLostError as error:
        assert "peer rank 0 exited in the middle of a collective" in str(error), error
    else:
        raise AssertionError("an all-reduce rank 0 abandoned completed")
    assert time.monotonic() - started < TIMEOUT / 2, "rank 0's exit was not heard of promptly"
    print("rank 1: exit mid-collective ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
