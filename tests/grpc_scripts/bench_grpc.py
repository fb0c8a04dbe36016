"""All-reduce timing over the gRPC transport: 2 processes on 127.0.0.1, float32 sum.

    python tests/grpc_scripts/bench_grpc.py [--ranks 2] [--algorithm ring] [--iters 20]
        [--sizes 4096,1048576,16777216,67108864]

Starts its own ranks (with the COLLECTIVES_* variables on free loopback ports) and prints, per
size, the median over iterations of rank 0's time, in the nccl-tests columns
(algbw = bytes / time, busbw = algbw * 2(p-1)/p), and the CPU cores each rank used.

``--raw`` instead times the ceiling of plain gRPC on this machine: 2 processes each push the
same number of bytes to the other over one stream of 1 MiB messages (what a 2-rank ring moves per
all-reduce), with none of the transport's logic. Noisy shared machines: compare the two in
alternating runs and quote ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    from collectives import Communicator
    from collectives.backends.grpc import GrpcTransport

    comm = Communicator(GrpcTransport.from_environment(), timeout=120)
    rows = []
    for nbytes in args.sizes:
        x = np.ones(nbytes // 4, dtype=np.float32)
        out = np.empty_like(x)
        for _ in range(args.warmup):
            comm.allreduce(x, algorithm=args.algorithm, out=out)
        times = []
        cpu_start = time.process_time()
        wall_start = time.perf_counter()
        for _ in range(args.iters):
            comm.barrier()
            start = time.perf_counter()
            comm.allreduce(x, algorithm=args.algorithm, out=out)
            times.append(time.perf_counter() - start)
        cpu_share = (time.process_time() - cpu_start) / (time.perf_counter() - wall_start)
        wrong = int(np.count_nonzero(out != comm.size))
        rows.append(
            {"bytes": nbytes, "count": x.size, "median": statistics.median(times), "wrong": wrong, "cpu": cpu_share}
        )
    if comm.rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    comm.close()


def raw_worker(args: argparse.Namespace) -> None:
    """Each rank streams `size` bytes to the other while receiving as much; rank 0 reports."""
    import queue
    from concurrent import futures

    import grpc
    import numpy as np

    rank = int(os.environ["COLLECTIVES_RANK"])
    addresses = os.environ["COLLECTIVES_ADDRESSES"].split(",")
    identity = lambda data: data  # noqa: E731
    arrived: queue.SimpleQueue = queue.SimpleQueue()

    def sink(frames, context):  # noqa: ANN001
        for frame in frames:
            arrived.put(len(frame))
        return b""

    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    handler = grpc.method_handlers_generic_handler(
        "raw", {"Sink": grpc.stream_unary_rpc_method_handler(sink, identity, identity)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[handler], options=options)
    server.add_insecure_port(addresses[rank])
    server.start()
    channel = grpc.insecure_channel(addresses[1 - rank], options=options)
    grpc.channel_ready_future(channel).result(timeout=30)
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    stream = channel.stream_unary("/raw/Sink", request_serializer=identity, response_deserializer=identity)
    call = stream.future(iter(outbox.get, None))
    rows = []
    for nbytes in args.sizes:
        data = np.ones(nbytes, np.uint8)
        times = []
        for _ in range(args.warmup + args.iters):
            start = time.perf_counter()
            for lo in range(0, max(nbytes, 1), 1 << 20):
                outbox.put(data[lo : lo + (1 << 20)].tobytes())
            got = 0
            while got < nbytes:
                got += arrived.get()
            times.append(time.perf_counter() - start)
        rows.append(
            {
                "bytes": nbytes,
                "count": nbytes // 4,
                "median": statistics.median(times[args.warmup :]),
                "wrong": 0,
                "cpu": float("nan"),
            }
        )
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    time.sleep(0.5)  # let the peer finish its last exchange before the server goes
    outbox.put(None)
    call.result(timeout=30)
    server.stop(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--algorithm", default="ring")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sizes", default="4096,1048576,16777216,67108864")
    parser.add_argument("--raw", action="store_true", help="time plain gRPC streams instead (2 ranks)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        (raw_worker if args.raw else worker)(args)
        return 0
    if args.raw and args.ranks != 2:
        parser.error("--raw times 2 ranks")

    from grpc_world import World

    argv = [
        "--worker",
        *(["--raw"] if args.raw else []),
        "--algorithm",
        args.algorithm,
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--sizes",
        ",".join(map(str, args.sizes)),
    ]
    with World(Path(__file__), args.ranks, argv) as world:
        codes = world.wait(timeout=600)
    if any(codes):
        print(world.report(), file=sys.stderr)
        return 1
    line = next(text for text in world.outputs[0].splitlines() if text.startswith("RESULT "))
    rows = json.loads(line[len("RESULT ") :])
    p = args.ranks
    what = (
        "plain gRPC streams (ceiling), 1 MiB messages"
        if args.raw
        else f"gRPC transport, algorithm={args.algorithm}, float32 sum"
    )
    print(f"# {what}, {p} ranks on 127.0.0.1, median of {args.iters} iterations")
    print(
        f"{'size':>12} {'count':>10} {'type':>7} {'redop':>5} {'time(us)':>10} "
        f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6} {'cpu(cores)':>10}"
    )
    for row in rows:
        seconds = row["median"]
        algbw = row["bytes"] / seconds / 1e9
        busbw = algbw * 2 * (p - 1) / p
        print(
            f"{row['bytes']:>12} {row['count']:>10} {'float':>7} {'sum':>5} {seconds * 1e6:>10.1f} "
            f"{algbw:>11.3f} {busbw:>11.3f} {row['wrong']:>6} {row['cpu']:>10.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
