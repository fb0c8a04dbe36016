"""CuPy arrays through every collective on the threads backend, against the numpy reference.

Every rank is a thread on GPU 0. Results must be CuPy arrays on the input's device, match the
float64 reference within the dtype's tolerance, and be bit-identical on every rank; `out=` given
as a CuPy array is written in place. Skipped, with the reason, where CuPy or a GPU is missing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import ALGORITHMS, DTYPES, LARGE_COUNT, SEGMENT_BYTES, assert_reduced, make_input, same_bits, valid_ops
from processes import run_bounded

import collectives


def _gpu_missing() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (the gpu extra)"
    import cupy

    try:
        if not cupy.cuda.is_available():
            return "no CUDA GPU is visible to CuPy"
    except Exception as error:  # noqa: BLE001 - a broken driver is a reason to skip, said as it is
        return f"CuPy cannot reach a GPU: {error}"
    return None


_MISSING = _gpu_missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]

WORLD = 3
LAYOUT = [2, 1]
"""Three ranks on two emulated nodes, so that the hierarchical algorithms really split."""


def _on_gpu(array: np.ndarray) -> Any:
    import cupy

    with cupy.cuda.Device(0):
        return cupy.asarray(array)


def _host(array: Any) -> np.ndarray:
    import cupy

    assert isinstance(array, cupy.ndarray), f"expected a cupy array, got {type(array).__name__}"
    assert array.device.id == 0
    return cupy.asnumpy(array)


CASES = [
    pytest.param(algorithm, dtype, op, id=f"{algorithm}-{np.dtype(dtype)}-{op}")
    for algorithm in ("auto", *ALGORITHMS)
    for dtype in DTYPES
    for op in valid_ops(dtype)
]


@pytest.mark.parametrize(("algorithm", "dtype", "op"), CASES)
def test_allreduce_of_device_arrays(algorithm: str, dtype: Any, op: str) -> None:
    inputs = [make_input(rank, LARGE_COUNT, dtype, op) for rank in range(WORLD)]

    def body(comm: collectives.Communicator) -> np.ndarray:
        return _host(comm.allreduce(_on_gpu(inputs[comm.rank]), op=op, algorithm=algorithm))

    results = collectives.run_threads(body, WORLD, ranks_per_node=LAYOUT, segment_bytes=SEGMENT_BYTES)
    assert_reduced(results[0], inputs, op)
    assert all(same_bits(result, results[0]) for result in results)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_allreduce_in_place_and_into_out(dtype: Any) -> None:
    """`out=` a CuPy array (the input itself, or another) receives the result on every rank."""
    inputs = [make_input(rank, (7, 11), dtype) for rank in range(WORLD)]

    def body(comm: collectives.Communicator) -> tuple[np.ndarray, np.ndarray]:
        import cupy

        x = _on_gpu(inputs[comm.rank])
        out = cupy.empty_like(x)
        assert comm.allreduce(x, out=out) is out
        assert comm.allreduce(x, out=x) is x
        return _host(out), _host(x)

    for out, in_place in collectives.run_threads(body, WORLD, ranks_per_node=LAYOUT):
        assert_reduced(out, inputs, "sum")
        assert same_bits(out, in_place)


def test_other_collectives_of_device_arrays() -> None:
    inputs = [make_input(rank, (5, 3), np.float32) for rank in range(WORLD)]

    def body(comm: collectives.Communicator) -> list[np.ndarray]:
        x = _on_gpu(inputs[comm.rank])
        received, counts = comm.alltoall(_on_gpu(np.repeat(inputs[comm.rank][:1], WORLD, axis=0)))
        assert isinstance(counts, np.ndarray)  # the counts are bookkeeping, on the host
        return [
            _host(comm.allgather(x)),
            _host(comm.broadcast(x, root=1)),
            _host(comm.reduce_scatter(x)),
            _host(received),
        ]

    results = collectives.run_threads(body, WORLD, ranks_per_node=LAYOUT)
    for rank, (gathered, broadcast, scattered, received) in enumerate(results):
        np.testing.assert_array_equal(gathered, np.concatenate(inputs))
        np.testing.assert_array_equal(broadcast, inputs[1])
        assert_reduced(scattered, [x[_rows(rank)] for x in inputs], "sum")
        np.testing.assert_array_equal(received, np.concatenate([x[:1] for x in inputs]))


def _rows(rank: int) -> slice:
    """Rank `rank`'s rows of 5 split over 3 ranks (Horovod's layout: 2, 2, 1)."""
    return [slice(0, 2), slice(2, 4), slice(4, 5)][rank]


def test_a_host_rank_and_a_device_rank_agree_bit_for_bit_on_max() -> None:
    """Device data copied to and from a host rank's buffers (mixed ranks are the user's choice;
    the copies between them must still be exact)."""
    inputs = [make_input(rank, 1000, np.float32, "max") for rank in range(2)]

    def body(comm: collectives.Communicator) -> np.ndarray:
        x = inputs[comm.rank]
        result = comm.allreduce(_on_gpu(x) if comm.rank == 0 else x, op="max", algorithm="ring")
        return _host(result) if comm.rank == 0 else result

    first, second = collectives.run_threads(body, 2)
    assert same_bits(first, second)
    assert_reduced(first, inputs, "max")


STAGED_CHECK = Path(__file__).with_name("gpu_scripts") / "staged_check.py"


@pytest.mark.parametrize("backend", ["mpi", "grpc"])
def test_staged_backends_move_device_arrays(backend: str) -> None:
    """Two processes on the one GPU, under the launcher: every algorithm on CuPy arrays through
    pinned host memory (MPI's native all-reduce included)."""
    if backend == "mpi" and importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (the mpi extra)")
    if backend == "grpc" and importlib.util.find_spec("grpc") is None:
        pytest.skip("grpcio is not installed (the grpc extra)")
    command = [sys.executable, "-m", "collectives.launch", "-n", "2", "--backend", backend, str(STAGED_CHECK)]
    job = run_bounded(command, timeout=300, merge_stderr=True)
    assert job.returncode == 0, job.stdout
    for rank in range(2):
        assert f"rank {rank}: staged ok" in job.stdout, job.stdout


def _tensorflow_gpu_missing() -> str | None:
    if importlib.util.find_spec("tensorflow") is None:
        return "TensorFlow is not installed (the tf extra)"
    import tensorflow as tf

    return None if tf.config.list_logical_devices("GPU") else "TensorFlow sees no GPU"


_TF_MISSING = _tensorflow_gpu_missing() if _MISSING is None else None  # TensorFlow is imported only beside a GPU


@pytest.mark.skipif(_TF_MISSING is not None, reason=_TF_MISSING or "")
def test_eager_gpu_tensors_travel_through_dlpack() -> None:
    """An eager GPU tensor is all-reduced as a CuPy view of its memory (DLPack) and comes back as
    a GPU tensor, on every rank alike."""
    import tensorflow as tf

    from collectives import strategies

    def body(comm: collectives.Communicator) -> np.ndarray:
        with tf.device("/GPU:0"):
            tensor = tf.fill([1000], float(comm.rank + 1))
        result = strategies.allreduce(tensor, "sum", comm)
        assert "GPU" in result.device, result.device
        return result.numpy()

    for result in collectives.run_threads(body, 2):
        np.testing.assert_array_equal(result, np.full(1000, 3.0, np.float32))
