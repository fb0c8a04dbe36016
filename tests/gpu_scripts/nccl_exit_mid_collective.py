"""`mpi_scripts/exit_mid_collective.py` over NCCL, on device buffers, by `ALGORITHM`:

    python -m collectives.launch --backend nccl -n 2 nccl_exit_mid_collective.py ALGORITHM
    COLLECTIVES_BACKEND=nccl mpiexec -n 2 python nccl_exit_mid_collective.py ALGORITHM

Under the launcher the control transport is gRPC, whose peers see rank 0's stream end; under
`mpiexec` it is MPI, which carries rank 0's closing note, also to a rank waiting in NCCL's own
collective (`native`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi_scripts"))

import cupy  # noqa: E402
from exit_mid_collective import LAUNCHED, TIMEOUT, leave_or_be_left  # noqa: E402

import collectives  # noqa: E402

if __name__ == "__main__":
    comm = collectives.init(timeout=TIMEOUT, autotune="off")
    explained = "rank 0" if LAUNCHED else "peer rank 0 exited in the middle of a collective"
    sys.exit(leave_or_be_left(comm, cupy.ones(1 << 16, cupy.float32), sys.argv[1], explained))
