"""Ring (and other algorithms) against MPI's own all-reduce, in one run, under mpiexec.

    mpiexec -n 2 python tests/mpi_scripts/bench_mpi.py [--sizes 4K,1M,16M,64M] [--iters 15]
        [--algorithms ring,native] [--dtype float32] [--op sum] [--segment-bytes N] [--spin-seconds S]

Every iteration runs each algorithm once, in an order that alternates between iterations, each
call started right after an MPI barrier; a call's time is the slowest rank's. Rank 0 prints the
nccl-tests columns with the median time per algorithm, then the ratio of each algorithm's median
to the first algorithm named `native` (or the last one listed), which is the number to quote on a
shared, noisy machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from collectives import Communicator
from collectives.backends.mpi import SPIN_SECONDS, MPITransport
from collectives.core.layout import DEFAULT_SEGMENT_BYTES

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,1M,16M,64M")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--algorithms", default="ring,native")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--op", default="sum")
    parser.add_argument("--segment-bytes", type=int, default=DEFAULT_SEGMENT_BYTES)
    parser.add_argument("--spin-seconds", type=float, default=SPIN_SECONDS, help="MPITransport's busy-poll phase")
    args = parser.parse_args()
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    algorithms = args.algorithms.split(",")
    baseline = "native" if "native" in algorithms else algorithms[-1]
    transport = MPITransport.from_environment(spin_seconds=args.spin_seconds)
    comm = Communicator(transport, segment_bytes=args.segment_bytes)
    dtype = np.dtype(args.dtype)
    p = comm.size
    if comm.rank == 0:
        print(
            f"# {p} ranks, {MPI.Get_library_version().splitlines()[0].strip()}, op={args.op}, "
            f"median of {args.iters} interleaved iterations, "
            f"segment_bytes={args.segment_bytes}, spin_seconds={transport.spin_seconds:g}"
        )
        print(
            f"{'size':>10} {'count':>10} {'type':>8} {'redop':>6} {'algorithm':>18} {'time(us)':>10} "
            f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6}"
        )
    ratios: list[str] = []
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        count = nbytes // dtype.itemsize
        x = (np.arange(count) % 7 + comm.rank).astype(dtype)
        expected = (np.arange(count) % 7 * p + p * (p - 1) // 2).astype(dtype)
        out = np.empty_like(x)
        times: dict[str, list[float]] = {a: [] for a in algorithms}
        wrong = {a: 0 for a in algorithms}
        for iteration in range(args.warmup + args.iters):
            order = algorithms if iteration % 2 == 0 else algorithms[::-1]
            for algorithm in order:
                world.Barrier()
                start = time.perf_counter()
                comm.allreduce(x, op=args.op, algorithm=algorithm, out=out)
                elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
                if iteration >= args.warmup:
                    times[algorithm].append(elapsed)
                    if args.op == "sum":
                        wrong[algorithm] += int(np.count_nonzero(out != expected))
        medians = {a: statistics.median(t) for a, t in times.items()}
        if comm.rank == 0:
            for algorithm in algorithms:
                seconds = medians[algorithm]
                algbw = nbytes / seconds / 1e9
                busbw = algbw * 2 * (p - 1) / p
                print(
                    f"{human(nbytes):>10} {count:>10} {dtype.name:>8} {args.op:>6} {algorithm:>18} "
                    f"{seconds * 1e6:>10.1f} {algbw:>11.2f} {busbw:>11.2f} {wrong[algorithm]:>6}"
                )
            for algorithm in algorithms:
                if algorithm != baseline:
                    ratio = medians[algorithm] / medians[baseline]
                    ratios.append(f"{human(nbytes):>10}: {algorithm}/{baseline} = {ratio:.3f}")
    if comm.rank == 0:
        print("# time ratios (median/median)")
        for line in ratios:
            print(line)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
