"""Run the library's all-reduce algorithms on the simulated backend (`backends.simulated`).

Each rank runs the algorithm on a bare `Group` of the whole world, without a `Communicator`: no
header agreement (its empty messages would add about log2(p) alpha to every algorithm alike), no
communication thread, and buffers from `SimulatedTransport.empty`, so timing-only runs allocate
nothing. The time of a run is when the last rank finishes; all ranks start at time 0.
"""

from __future__ import annotations

import math

import numpy as np

from backends.simulated import Cluster, SimulatedTransport, SimulationResult, simulate

from .allreduce import run_allreduce
from .group import SUBTAGS_PER_COLLECTIVE, Group
from .layout import DEFAULT_SEGMENT_BYTES
from .ops import ReduceOp
from .topology import Topology


def simulate_allreduce(
    cluster: Cluster,
    algorithm: str,
    nbytes: int,
    *,
    dtype: str = "float32",
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    timing_only: bool = True,
) -> SimulationResult[np.ndarray | None]:
    """Simulate one sum all-reduce of `nbytes` per rank with `algorithm` on `cluster`.

    With `timing_only=False` every rank reduces real data (rank r contributes r + 1 everywhere)
    and returns its result, so correctness can be checked too.
    """
    itemsize = np.dtype(dtype).itemsize
    count = nbytes // itemsize
    nodes = Topology(cluster.hosts).nodes
    header = f"simulated allreduce algorithm={algorithm} count={count} dtype={dtype}".encode()

    def rank_main(transport: SimulatedTransport) -> np.ndarray | None:
        group = Group(transport, tuple(range(transport.size)), SUBTAGS_PER_COLLECTIVE, header, math.inf, math.inf)
        src = transport.empty(count, dtype)
        src[...] = transport.rank + 1
        dst = transport.empty(count, dtype)
        run_allreduce(algorithm, group, nodes, src, dst, ReduceOp.SUM, segment_bytes=segment_bytes)
        return None if timing_only else dst.view(np.ndarray)

    return simulate(rank_main, cluster, timing_only=timing_only)
