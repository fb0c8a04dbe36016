"""The last rank SIGKILLs itself in the middle of a stream of all-reduces.

    mpiexec [-disable-auto-cleanup] -n 3 python kill_peer.py TIMEOUT_SECONDS OUTPUT_DIR

Every rank that sees a collective fail writes "NAME seconds message" to OUTPUT_DIR/rank{R}.txt
(a file, because hydra may kill the job before forwarded output is flushed) and exits 3; a rank
whose collectives never fail writes "finished" (which must not happen).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from collectives import CollectiveError, Communicator
from collectives.backends.mpi import MPITransport


def main() -> int:
    timeout = float(sys.argv[1])
    comm = Communicator(MPITransport.from_environment(), timeout=timeout)
    return stream_until_killed(comm, np.ones(1 << 20, np.float32), timeout, Path(sys.argv[2]), "ring")


def stream_until_killed(comm: Communicator, x: Any, timeout: float, output: Path, algorithm: str) -> int:
    """All-reduce `x` until the last rank, which SIGKILLs itself after three, is missed; report
    how (see the module docstring). Also the body of the NCCL killed-peer script."""
    report = output / f"rank{comm.rank}.txt"
    victim = comm.size - 1
    for _ in range(3):
        comm.allreduce(x, algorithm=algorithm)  # every connection the algorithm needs exists
    if comm.rank == victim:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        while time.monotonic() - start < 4 * timeout + 30:
            comm.allreduce(x, algorithm=algorithm)
    except CollectiveError as error:
        _write_whole(report, f"{type(error).__name__} {time.monotonic() - start:.3f} {error}\n")
        print(f"rank {comm.rank}: raised {type(error).__name__}: {error}", flush=True)
        comm.close()
        return 3
    _write_whole(report, "finished\n")
    return 0


def _write_whole(report: Path, text: str) -> None:
    """Write `report` so that it appears whole or not at all: the launcher may kill this rank at
    any moment once its peer is dead, and a half-written report reads as an empty one."""
    partial = report.with_suffix(".part")
    partial.write_text(text)
    os.replace(partial, report)


if __name__ == "__main__":
    sys.exit(main())
