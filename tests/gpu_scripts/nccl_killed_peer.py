"""The last rank SIGKILLs itself in the middle of a stream of device all-reduces over NCCL.

    python -m collectives.launch --backend nccl -n 2 nccl_killed_peer.py TIMEOUT_SECONDS OUTPUT_DIR ALGORITHM

Reports as `mpi_scripts/kill_peer.py` does (a file per rank that saw a collective fail; the
launcher stops the survivors soon after a rank dies).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi_scripts"))

import cupy  # noqa: E402
from kill_peer import stream_until_killed  # noqa: E402

import collectives  # noqa: E402

if __name__ == "__main__":
    timeout, output, algorithm = float(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    comm = collectives.init(timeout=timeout, autotune="off")
    sys.exit(stream_until_killed(comm, cupy.ones(1 << 20, cupy.float32), timeout, output, algorithm))
