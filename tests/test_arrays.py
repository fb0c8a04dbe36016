"""Device arrays where no GPU is needed to check them: which module a buffer belongs to, the clear
errors without CuPy, and host-only transports refusing device memory before anything is sent."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

import collectives
from collectives.backends import device
from collectives.backends.base import check_host_buffer
from collectives.backends.errors import BackendUnavailableError
from collectives.core import arrays


class FakeDeviceArray:
    """What a foreign device array shows of itself: `__cuda_array_interface__` and array attributes."""

    def __init__(self, count: int) -> None:
        self.shape = (count,)
        self.ndim = 1
        self.dtype = np.dtype(np.float32)
        self.nbytes = 4 * count
        self.flags = np.empty(0).flags  # C-contiguous
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": "<f4", "data": (0, False), "version": 3}


def test_host_arrays_are_numpy_device_arrays_are_not() -> None:
    assert not arrays.is_device(np.zeros(3)) and arrays.array_module(np.zeros(3)) is np
    assert arrays.is_device(FakeDeviceArray(3))
    assert not arrays.may_share_memory(np.zeros(3), FakeDeviceArray(3))
    assert arrays.same_device(np.zeros(1), np.zeros(2)) and not arrays.same_device(np.zeros(1), FakeDeviceArray(1))


needs_no_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")


@needs_no_cupy
def test_a_device_array_without_cupy_names_the_gpu_extra() -> None:
    """A device array reaching a collective where CuPy is missing: BackendUnavailableError saying
    what to install, raised before anything is sent."""
    arrays.cupy.cache_clear()
    with pytest.raises(BackendUnavailableError, match=r"pip install -e '\.\[gpu\]'"):
        collectives.run_threads(lambda comm: comm.allreduce(FakeDeviceArray(4)), 2)
    with pytest.raises(BackendUnavailableError, match="cupy"):
        device.ready_event(FakeDeviceArray(4))


@pytest.mark.parametrize("transport", ["MPI", "gRPC"])
def test_host_transports_refuse_device_memory(transport: str) -> None:
    """MPI (not CUDA-aware in the `mpich` wheel) and gRPC would be handed a device pointer: a
    TypeError saying the transport moves host memory and what to do instead."""
    with pytest.raises(TypeError, match=f"the {transport} transport moves host memory only") as caught:
        check_host_buffer(FakeDeviceArray(4), transport)
    assert "cupy.asnumpy" in str(caught.value)
    check_host_buffer(np.zeros(4, np.float32), transport)  # host memory passes


def test_numpy_results_stay_numpy() -> None:
    """The host path is unchanged: numpy in, numpy out, for every collective."""

    def body(comm: collectives.Communicator) -> list[Any]:
        x = np.arange(6, dtype=np.float32)
        return [comm.allreduce(x), comm.allgather(x), comm.broadcast(x), comm.reduce_scatter(x)]

    for results in collectives.run_threads(body, 2):
        assert all(type(result) is np.ndarray for result in results)
