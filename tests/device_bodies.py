"""Collective bodies on CuPy buffers, written once and run on threads and in MPI and gRPC jobs.

Each body takes a communicator whose ranks all use GPU 0, puts its inputs on the device, and
checks that results come back as CuPy arrays on the input's device, match the float64 reference
of `bodies.py`, and are bit-identical on every rank. test_gpu.py runs them over threads; as a
script (`python device_bodies.py NAME...`, under `mpiexec` or `python -m collectives.launch`, run
like `run_body.py`) they run over MPI or gRPC, which `Communicator` stages through pinned host memory.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bodies import (  # noqa: E402
    COUNTS,
    DTYPES,
    OPS,
    assert_close,
    assert_identical_everywhere,
    extrema_with_nan_and_signed_zeros,
    rank_input,
    reference,
)

import collectives  # noqa: E402
from collectives import Communicator  # noqa: E402


def _cupy() -> Any:
    import cupy

    cupy.cuda.Device(0).use()  # every rank of a one-GPU machine, and every thread
    return cupy


def _on_host(result: Any, x: Any, what: str) -> np.ndarray:
    """`result` checked to be a CuPy array on `x`'s device, as a numpy array."""
    cupy = _cupy()
    assert isinstance(result, cupy.ndarray), f"{what}: result is a {type(result).__name__}, not a CuPy array"
    assert result.device.id == x.device.id, f"{what}: result on device {result.device.id}, input on {x.device.id}"
    return cupy.asnumpy(result)


def device_allreduce_every_algorithm(comm: Communicator) -> None:
    """Every algorithm (native too where the backend has one) x counts x dtypes x ops on CuPy
    buffers; `out=` given as CuPy and in place once per algorithm and dtype."""
    cupy = _cupy()
    case = 0
    for algorithm in [*comm.algorithms, "auto"]:
        for dtype in DTYPES:
            if algorithm == collectives.NATIVE and np.dtype(dtype) not in comm.native_dtypes:
                continue
            for count in COUNTS:
                for op in OPS:
                    if op == "mean" and np.dtype(dtype).kind == "i":
                        continue
                    case += 1
                    inputs = [rank_input(rank, count, dtype, case) for rank in range(comm.size)]
                    x = cupy.asarray(inputs[comm.rank])
                    what = f"device allreduce {algorithm} count={count} {dtype} {op}"
                    result = _on_host(comm.allreduce(x, op=op, algorithm=algorithm), x, what)
                    np.testing.assert_array_equal(cupy.asnumpy(x), inputs[comm.rank], err_msg=f"{what}: input modified")
                    assert_close(result, reference(inputs, op), dtype, comm.size, what)
                    assert_identical_everywhere(comm, result, what)
            out = cupy.empty(COUNTS[-1], dtype)
            x = cupy.asarray(rank_input(comm.rank, COUNTS[-1], dtype, case))
            given = comm.allreduce(x, algorithm=algorithm, out=out)
            assert given is out, f"{algorithm} {dtype}: out= was not returned"
            expected = cupy.asnumpy(out)
            assert comm.allreduce(x, algorithm=algorithm, out=x) is x
            np.testing.assert_array_equal(cupy.asnumpy(x), expected, err_msg=f"{algorithm} {dtype}: in place")


def device_other_collectives(comm: Communicator) -> None:
    """reduce_scatter, allgather, broadcast and alltoall of CuPy buffers give exactly the results
    of the same calls on numpy buffers, on the input's device."""
    cupy = _cupy()
    for dtype in DTYPES:
        for count in COUNTS:
            host = rank_input(comm.rank, count, dtype, 0)
            x = cupy.asarray(host)
            rows = np.concatenate([host] * comm.size)
            calls: list[tuple[str, Callable[[Any], Any], Any]] = [
                ("reduce_scatter", lambda a: comm.reduce_scatter(a), host),
                ("allgather", lambda a: comm.allgather(a), host),
                ("broadcast", lambda a: comm.broadcast(a, root=comm.size - 1), host),
                ("alltoall", lambda a: comm.alltoall(a)[0], rows),
            ]
            for name, call, data in calls:
                what = f"device {name} count={count} {dtype}"
                on_device = cupy.asarray(data) if data is rows else x
                result = _on_host(call(on_device), on_device, what)
                np.testing.assert_array_equal(result, call(data), err_msg=what)
                if name != "reduce_scatter":  # every rank keeps its own block there
                    assert_identical_everywhere(comm, result, what)


def device_stream_order(comm: Communicator) -> None:
    """An input still being computed on the caller's own stream when the call is made (async and
    blocking) is read only once it is done; the result is complete when `wait()` returns."""
    cupy = _cupy()
    stream = cupy.cuda.Stream(non_blocking=True)
    count = 1 << 22
    for blocking in (False, True):
        with stream:
            x = cupy.zeros(count, cupy.float32)
            for _ in range(20):  # a queue of kernels still running when the collective is called
                x += cupy.float32(comm.rank + 1)
            result = comm.allreduce(x) if blocking else comm.allreduce_async(x).wait()
        expected = 20.0 * comm.size * (comm.size + 1) / 2
        assert float(cupy.asnumpy(result).min()) == float(cupy.asnumpy(result).max()) == expected, (
            f"blocking={blocking}: result not {expected} everywhere"
        )


def device_extrema_with_nan_and_signed_zeros(comm: Communicator) -> None:
    """`bodies.extrema_with_nan_and_signed_zeros` on CuPy buffers (over NCCL, its own float max
    and min would drop the NaN)."""
    cupy = _cupy()
    extrema_with_nan_and_signed_zeros(comm, place=cupy.asarray, fetch=cupy.asnumpy)


DEVICE_BODIES: dict[str, Callable[[Communicator], None]] = {
    "device_allreduce_every_algorithm": device_allreduce_every_algorithm,
    "device_other_collectives": device_other_collectives,
    "device_stream_order": device_stream_order,
    "device_extrema_with_nan_and_signed_zeros": device_extrema_with_nan_and_signed_zeros,
}


if __name__ == "__main__":
    import run_body

    run_body.BODIES.update(DEVICE_BODIES)  # run_body runs the bodies it finds in that table by name
    sys.exit(run_body.main(sys.argv[1:]))
