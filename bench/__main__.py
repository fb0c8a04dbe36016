"""`python -m bench`: compare all-reduce algorithms side by side.

Prints an nccl-tests style table (size, count, type, redop, algorithm, time, algbw, busbw, #wrong).
Defaults: threads backend, 4 ranks on 2 emulated nodes, float32 sum, 4 KiB to 64 MiB by factors
of 4. With `--backend mpi` or `--backend grpc` the ranks are real processes, started for you
(through mpiexec or `collectives.launch`); rank 0 hands its results back to this process.

`--explain` (after `--probe` or `--tune`, or with the default link costs) adds the cost model's
prediction for every row and marks the algorithm auto picks, so the table shows why.
`--backend simulated --nodes N --ranks-per-node L --intra ALPHA,GBPS --inter ALPHA,GBPS` prints
simulated time, prediction, auto's choice and its regret on a simulated cluster (bench.simulated).
`--emulate-nodes N --ranks-per-node L --inter-gbit G` runs the gRPC ranks on N nodes emulated with
Linux network namespaces, their links rate-limited to G Gbit/s (bench.netns; root only, else the
equivalent simulated cluster).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Sequence

import numpy as np

from collectives import ALLREDUCE_ALGORITHMS, NATIVE, run_threads

from . import netns
from .handoff import Row, read_rows, write_rows
from .measure import Measurement, format_table, measure_allreduce

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_DEFAULT_ALGORITHMS = {"threads": "ring,tree,hierarchical", "mpi": "ring,tree,hierarchical,native", "grpc": "ring,tree,hierarchical"}


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
    parser.add_argument("--backend", choices=("threads", "mpi", "grpc", "simulated"), default="threads")
    parser.add_argument("-n", "--ranks", type=int, default=None, help="number of ranks (default 4 on threads, 2 otherwise)")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="emulated ranks per node (default 2 on threads)")
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"))
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    parser.add_argument("-f", "--stepfactor", type=int, default=4)
    parser.add_argument(
        "-a",
        "--algorithms",
        default=None,
        help=f"comma-separated, from: auto,{','.join(ALLREDUCE_ALGORITHMS)},{NATIVE} (MPI only)",
    )
    parser.add_argument("-d", "--dtype", default="float32")
    parser.add_argument("-w", "--warmup", type=int, default=2, help="untimed iterations")
    parser.add_argument("-i", "--iters", type=int, default=9, help="timed iterations")
    parser.add_argument("--explain", action="store_true", help="add the model's prediction and auto's choice")
    parser.add_argument("--probe", action="store_true", help="probe the links first (comm.probe())")
    parser.add_argument("--tune", action="store_true", help="probe and tune first (comm.tune(), cached)")
    simulated = parser.add_argument_group("simulated backend")
    simulated.add_argument("--nodes", type=int, default=2)
    simulated.add_argument("--intra", type=_link, default="1e-6,50", help="ALPHA_SECONDS,GB_PER_S (default 1e-6,50)")
    simulated.add_argument("--inter", type=_link, default="10e-6,5", help="ALPHA_SECONDS,GB_PER_S (default 10e-6,5)")
    simulated.add_argument("--nic", type=float, default=10, help="GB/s through each node's NIC (default 10)")
    simulated.add_argument("--gamma", type=float, default=20, help="reduction GB/s (default 20)")
    emulated = parser.add_argument_group(
        "emulated nodes (bench.netns: Linux network namespaces, needs root; else runs the equivalent simulated cluster)"
    )
    emulated.add_argument("--emulate-nodes", type=int, default=None, metavar="N", help="run the grpc ranks in N network namespaces, --ranks-per-node each (default 2)")
    emulated.add_argument("--inter-gbit", type=float, default=1.0, help="rate limit of each node's link, each way, in Gbit/s (default 1)")
    emulated.add_argument("--emulate-timeout", type=float, default=netns.DEFAULT_RUN_TIMEOUT_SECONDS, metavar="SECONDS", help="stop the ranks after this long (default 600)")
    parser.add_argument("--worker-output", help=argparse.SUPPRESS)  # set when started as a rank
    return parser


def _link(text: str):
    from backends.simulated import Link

    try:
        alpha, gbps = (float(x) for x in text.split(","))
        return Link(alpha, gbps * 1e9)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ALPHA_SECONDS,GB_PER_S such as 1e-6,50; got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.emulate_nodes is not None and not args.worker_output:
        try:
            args = netns.resolve_arguments(args)
        except ValueError as error:
            print(f"python -m bench: {error}", file=sys.stderr)
            return 2
    if args.backend == "simulated":
        return _simulated(args)
    algorithms = [a.strip() for a in (args.algorithms or _DEFAULT_ALGORITHMS[args.backend]).split(",") if a.strip()]
    unknown = sorted(set(algorithms) - {"auto", NATIVE, *ALLREDUCE_ALGORITHMS})
    if unknown:
        print(f"unknown algorithm(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    if NATIVE in algorithms and args.backend != "mpi":
        print(f"algorithm {NATIVE!r} needs --backend mpi", file=sys.stderr)
        return 2
    sizes = size_range(args.minbytes, args.maxbytes, args.stepfactor)

    def measure(comm) -> list[Measurement]:
        if args.tune:
            comm.tune()
        elif args.probe:
            comm.probe()
        rows = measure_allreduce(comm, sizes, algorithms, dtype=args.dtype, warmup=args.warmup, iterations=args.iters)
        if args.explain:
            explained = {n: comm.explain(row_bytes(n, args.dtype)) for n in sizes}
            rows = [(row, explained[_size_of(row, sizes, args.dtype)]) for row in rows]
        return rows

    if args.worker_output:
        return _run_as_rank(measure, args.worker_output)
    ranks = args.ranks or (4 if args.backend == "threads" else 2)
    per_node = args.ranks_per_node or (2 if args.backend == "threads" else None)
    print(
        f"# all-reduce, {args.backend} backend, {ranks} ranks"
        f"{f', {per_node} per node' if per_node else ''}, {args.dtype} sum; "
        f"time = median over {args.iters} iterations of the slowest rank"
    )
    if args.backend == "threads":
        rows = run_threads(measure, ranks, ranks_per_node=per_node)[0]
    elif args.emulate_nodes is not None:
        rows = netns.run_on_emulated_nodes(args, sys.argv[1:] if argv is None else list(argv))
        if rows is None:
            return 1
    else:
        rows = _run_in_processes(args.backend, ranks, per_node, sys.argv[1:] if argv is None else list(argv))
        if rows is None:
            return 1
    if args.explain:
        print(format_explained(rows))
    else:
        print(format_table(rows))
    if args.emulate_nodes is not None:
        print(netns.comparison(rows))
    if args.explain:
        rows = [row for row, _ in rows]
    return 1 if any(row.wrong for row in rows) else 0


def row_bytes(nbytes: int, dtype: str) -> int:
    """The payload bytes of a row of `nbytes` requested (whole elements)."""
    itemsize = np.dtype(dtype).itemsize
    return nbytes // itemsize * itemsize


def _size_of(row: Measurement, sizes: Sequence[int], dtype: str) -> int:
    return next(n for n in sizes if row_bytes(n, dtype) == row.nbytes)


def format_explained(rows) -> str:
    """Measured time beside the model's (tuned, if tuned) prediction; `*` marks auto's pick."""
    lines = [f"{'size':>12} {'algorithm':>18} {'measured(us)':>13} {'model(us)':>11} {'auto':>5} {'#wrong':>7}"]
    for row, explanation in rows:
        predicted = explanation.corrected.get(row.algorithm)
        model = f"{predicted * 1e6:>11.1f}" if predicted is not None else f"{'-':>11}"
        mark = explanation.choice if row.algorithm == "auto" else ("*" if row.algorithm == explanation.choice else "")
        lines.append(f"{row.nbytes:>12} {row.algorithm:>18} {row.seconds * 1e6:>13.1f} {model} {mark:>5} {row.wrong:>7}")
    return "\n".join(lines)


def _simulated(args: argparse.Namespace) -> int:
    from backends.simulated import Cluster

    from .simulated import regret_table

    per_node = args.ranks_per_node or 4
    cluster = Cluster(args.nodes, per_node, args.intra, args.inter, nic_bandwidth=args.nic * 1e9, gamma=1 / (args.gamma * 1e9))
    print(f"# all-reduce on a simulated cluster of {args.nodes} x {per_node} ranks (virtual time)")
    table, worst = regret_table(cluster, size_range(args.minbytes, args.maxbytes, args.stepfactor))
    print(table)
    print(f"# max regret of auto: {worst * 100:.1f}%")
    return 0


def _run_as_rank(measure, output_path: str) -> int:
    """Inside a launched job: measure on this rank; rank 0 writes the rows for the parent."""
    import collectives

    comm = collectives.init()
    rows = measure(comm)
    if comm.rank == 0:
        write_rows(output_path, rows)
    comm.close()
    return 0


def _run_in_processes(backend: str, ranks: int, per_node: int | None, argv: list[str]) -> list[Row] | None:
    """Start `ranks` processes of this benchmark through the launcher and collect rank 0's rows."""
    with tempfile.TemporaryDirectory() as scratch:
        output_path = os.path.join(scratch, "rows.json")
        command = [sys.executable, "-m", "collectives.launch", "-n", str(ranks), "--backend", backend]
        if per_node:
            command += ["--ranks-per-node", str(per_node)]
        command += ["-m", "bench", *argv, "--worker-output", output_path]
        finished = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if finished.returncode != 0 or not os.path.exists(output_path):
            print(f"the {backend} ranks failed (exit code {finished.returncode}):\n{finished.stdout}", file=sys.stderr)
            return None
        return read_rows(output_path)


if __name__ == "__main__":
    sys.exit(main())
