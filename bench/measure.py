"""Timing of all-reduce algorithms on a live communicator, nccl-tests style.

Each iteration starts right after a barrier and its time is the slowest rank's (a collective is
only done when every rank is); the reported time is the median over iterations. Algorithms are
interleaved round by round at each size, so a burst of machine noise hits all of them alike.
The payload is chosen so that the exact result is known, and `wrong` counts elements that differ.

Beside the algorithms, every size gets a `copy-bound` row: all ranks copy their input to their
output at once, with numpy, and nothing else. Any all-reduce must at least read each input and
write each output, so on a memory-bound machine this is the fastest any algorithm can be; its
busbw is the ceiling the algorithms are measured against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from collectives import Communicator

COPY_BOUND = "copy-bound"


@dataclass(frozen=True)
class Measurement:
    """One row of the results table."""

    nbytes: int
    count: int
    dtype: str
    op: str
    algorithm: str
    seconds: float
    """Median over iterations of the slowest rank's time."""
    ranks: int
    wrong: int
    """Elements differing from the exact expected result, summed over ranks and iterations."""

    @property
    def algbw(self) -> float:
        """Bytes per second of payload: nccl-tests' `algbw`."""
        return self.nbytes / self.seconds if self.seconds > 0 else float("inf")

    @property
    def busbw(self) -> float:
        """`algbw * 2(p-1)/p`: comparable with link bandwidth whatever the rank count."""
        return self.algbw * 2 * (self.ranks - 1) / self.ranks if self.ranks > 1 else self.algbw


def payload(rank: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Small integers, exact in every dtype, different on every rank and element."""
    return ((np.arange(count) % 7 + 1) * (rank + 1)).astype(dtype)


def expected_sum(size: int, count: int, dtype: np.dtype) -> np.ndarray:
    """The exact all-reduce sum of `payload` over `size` ranks."""
    return ((np.arange(count) % 7 + 1) * (size * (size + 1) // 2)).astype(dtype)


def measure_allreduce(
    comm: Communicator,
    sizes: Sequence[int],
    algorithms: Sequence[str],
    *,
    dtype: str = "float32",
    warmup: int = 2,
    iterations: int = 10,
    rounds: int = 3,
) -> list[Measurement]:
    """Time `algorithms` at every size in bytes; run on every rank, same arguments everywhere.

    Each algorithm runs `warmup` untimed iterations, then `rounds` rounds of `iterations // rounds`
    (at least one) timed iterations, interleaved with the other algorithms.
    """
    np_dtype = np.dtype(dtype)
    per_round = max(1, iterations // rounds)
    rows = []
    for nbytes in sizes:
        count = nbytes // np_dtype.itemsize
        src = payload(comm.rank, count, np_dtype)
        dst = np.empty_like(src)
        expected = expected_sum(comm.size, count, np_dtype)
        times: dict[str, list[float]] = {a: [] for a in algorithms}
        wrong = {a: 0 for a in algorithms}
        for algorithm in algorithms:
            for _ in range(warmup):
                comm.allreduce(src, algorithm=algorithm, out=dst)
        times[COPY_BOUND] = []
        for _ in range(rounds):
            for algorithm in algorithms:
                for _ in range(per_round):
                    comm.barrier()
                    start = time.perf_counter()
                    comm.allreduce(src, algorithm=algorithm, out=dst)
                    times[algorithm].append(time.perf_counter() - start)
                    wrong[algorithm] += int(np.count_nonzero(dst != expected))
            for _ in range(per_round):
                comm.barrier()
                start = time.perf_counter()
                np.copyto(dst, src)
                times[COPY_BOUND].append(time.perf_counter() - start)
        wrong[COPY_BOUND] = 0
        for algorithm in [*algorithms, COPY_BOUND]:
            slowest = comm.allreduce(np.array(times[algorithm]), op="max")
            total_wrong = int(comm.allreduce(np.array([wrong[algorithm]], dtype=np.int64))[0])
            rows.append(
                Measurement(
                    nbytes=count * np_dtype.itemsize,
                    count=count,
                    dtype=np_dtype.name,
                    op="sum",
                    algorithm=algorithm,
                    seconds=float(np.median(slowest)),
                    ranks=comm.size,
                    wrong=total_wrong,
                )
            )
    return rows


def format_table(rows: Sequence[Measurement]) -> str:
    """The nccl-tests columns (plus the algorithm), one line per measurement."""
    header = (
        f"{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'algorithm':>18} "
        f"{'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}"
    )
    lines = [header]
    for row in rows:
        lines.append(
            f"{row.nbytes:>12} {row.count:>12} {row.dtype:>8} {row.op:>6} {row.algorithm:>18} "
            f"{row.seconds * 1e6:>11.1f} {row.algbw / 1e9:>12.3f} {row.busbw / 1e9:>12.3f} "
            f"{row.wrong:>7}"
        )
    return "\n".join(lines)
