"""Run the library's all-reduce algorithms on the simulated backend (`backends.simulated`).

Each rank runs the algorithm on a bare `Group` of the whole world, without a `Communicator`: no
header agreement (its empty messages would add about log2(p) alpha to every algorithm alike), no
communication thread, and buffers from `SimulatedTransport.empty`, so timing-only runs allocate
nothing. The time of a run is when the last rank finishes; all ranks start at time 0.

The algorithm runs as its step machine (`allreduce.allreduce_steps`) under `simulate_steps`, every
rank in one thread: the same code and the same virtual times as running `run_allreduce` on a thread
per rank under `simulate`, several times faster in real time (see `backends.simulated`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from backends.simulated import Cluster, RankSteps, SimulatedTransport, SimulationResult, simulate, simulate_steps

from .allreduce import allreduce_steps
from .group import SUBTAGS_PER_COLLECTIVE, Group, Pending
from .layout import DEFAULT_SEGMENT_BYTES
from .ops import ReduceOp
from .schedule import Waits, drive
from .topology import Topology


def simulate_allreduce(
    cluster: Cluster,
    algorithm: str,
    nbytes: int,
    *,
    dtype: str = "float32",
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    timing_only: bool = True,
    threaded: bool = False,
) -> SimulationResult[np.ndarray | None]:
    """Simulate one sum all-reduce of `nbytes` per rank with `algorithm` on `cluster`.

    With `timing_only=False` every rank reduces real data (rank r contributes r + 1 everywhere)
    and returns its result, so correctness can be checked too. With `threaded=True` each rank waits
    for its operations blocking, as `run_allreduce` does, on its own thread under `simulate`: the
    same virtual times, far slower; what the one-thread driver is checked and benchmarked against.
    """
    itemsize = np.dtype(dtype).itemsize
    count = nbytes // itemsize
    nodes = Topology(cluster.hosts).nodes
    header = f"simulated allreduce algorithm={algorithm} count={count} dtype={dtype}".encode()

    def start(transport: SimulatedTransport) -> tuple[Group, Waits, np.ndarray]:
        group = Group(transport, tuple(range(transport.size)), SUBTAGS_PER_COLLECTIVE, header, math.inf, math.inf)
        src = transport.empty(count, dtype)
        src[...] = transport.rank + 1
        dst = transport.empty(count, dtype)
        return group, allreduce_steps(algorithm, group, nodes, src, dst, ReduceOp.SUM, segment_bytes=segment_bytes), dst

    def rank_main(transport: SimulatedTransport) -> RankSteps[np.ndarray | None]:
        _, waits, dst = start(transport)
        yield from rank_steps(waits)
        return None if timing_only else dst.view(np.ndarray)

    def rank_thread(transport: SimulatedTransport) -> np.ndarray | None:
        group, waits, dst = start(transport)
        drive(group, waits)
        return None if timing_only else dst.view(np.ndarray)

    if threaded:
        return simulate(rank_thread, cluster, timing_only=timing_only)
    return simulate_steps(rank_main, cluster, timing_only=timing_only)


def rank_steps(waits: Waits) -> RankSteps[None]:
    """A collective's step machine as the simulator runs it: the requests of what it waits for.

    A failed request's error is thrown into `waits` where it waited, as `Group.wait` would raise
    it there. Group deadlines and header agreements do not apply: simulated waits never time out,
    and `simulate_allreduce` runs without an agreement.
    """
    value: int | None = None
    error: Exception | None = None
    while True:
        try:
            item = waits.send(value) if error is None else waits.throw(error)
        except StopIteration:
            return
        single = isinstance(item, Pending)
        requests: Sequence = (item.request,) if single else [pending.request for pending in item]
        try:
            index = yield requests
        except Exception as failure:  # noqa: BLE001 - a request's error, raised where `waits` waited
            value, error = None, failure
        else:
            value, error = (None if single else index), None
