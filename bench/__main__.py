"""`python -m bench`: compare all-reduce algorithms side by side on the threads backend.

Prints an nccl-tests style table (size, count, type, redop, algorithm, time, algbw, busbw, #wrong).
Defaults: 4 ranks on 2 emulated nodes, float32 sum, 4 KiB to 64 MiB by factors of 4.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from collectives import ALLREDUCE_ALGORITHMS, run_threads

from .measure import format_table, measure_allreduce

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'4K', '64M', '1G' or a plain byte count, as bytes."""
    text = text.strip().upper().removesuffix("B")
    unit = text[-1:] if text[-1:] in _UNITS else ""
    number = text[: len(text) - len(unit)]
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4K, 64M or 1048576)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size must not be negative, got {text!r}")
    return value


def size_range(begin: int, end: int, factor: int) -> list[int]:
    """nccl-tests' -b/-e/-f sweep: begin, begin*factor, ... up to end."""
    if factor < 2:
        raise ValueError(f"the size factor must be >= 2, got {factor}")
    sizes = []
    size = max(begin, 1)
    while size <= end:
        sizes.append(size)
        size *= factor
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--ranks", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument(
        "--ranks-per-node", type=int, default=2, help="emulated ranks per node (default 2)"
    )
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"))
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    parser.add_argument("-f", "--stepfactor", type=int, default=4)
    parser.add_argument(
        "-a",
        "--algorithms",
        default="ring,tree,hierarchical",
        help=f"comma-separated, from: auto,{','.join(ALLREDUCE_ALGORITHMS)}",
    )
    parser.add_argument("-d", "--dtype", default="float32")
    parser.add_argument("-w", "--warmup", type=int, default=2, help="untimed iterations")
    parser.add_argument("-i", "--iters", type=int, default=9, help="timed iterations")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = sorted(set(algorithms) - {"auto", *ALLREDUCE_ALGORITHMS})
    if unknown:
        print(f"unknown algorithm(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    sizes = size_range(args.minbytes, args.maxbytes, args.stepfactor)
    print(
        f"# all-reduce, threads backend, {args.ranks} ranks, {args.ranks_per_node} per node, "
        f"{args.dtype} sum; time = median over {args.iters} iterations of the slowest rank"
    )
    results = run_threads(
        lambda comm: measure_allreduce(
            comm, sizes, algorithms, dtype=args.dtype, warmup=args.warmup, iterations=args.iters
        ),
        args.ranks,
        ranks_per_node=args.ranks_per_node,
    )
    rows = results[0]
    print(format_table(rows))
    return 1 if any(row.wrong for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
