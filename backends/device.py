"""The few CUDA runtime calls the backends make on device buffers, through CuPy.

A request on a device buffer completes only once the GPU has finished its work, never when the
work is merely enqueued: the rank that then reads the buffer (or reuses it) may do so from
another thread and another stream. So a posted device buffer records an event on the poster's
current stream (`ready_event`): whatever kernels produced it come first. The copy that delivers a
message waits for both sides' events, runs as one `cudaMemcpyAsync` with `cudaMemcpyDefault`
(unified addressing works out host, device and peer-device directions), and is synchronized before
the request is completed.

CuPy is imported on first use (`cupy()`): backends import this module freely, and numpy-only
processes never load CuPy. `collectives.core.arrays` builds the algorithms' array-module choice
on `is_device` and `cupy` from here.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import numpy as np

from .errors import BackendUnavailableError


def is_device(array: Any) -> bool:
    """Whether `array` lives in GPU memory (has `__cuda_array_interface__`); numpy arrays are
    answered first, without the failed attribute lookup, since they are the hot path."""
    return not isinstance(array, np.ndarray) and hasattr(array, "__cuda_array_interface__")


@functools.cache
def cupy() -> ModuleType:
    """The `cupy` module, imported on first use.

    Raises:
        BackendUnavailableError: CuPy is not installed (the `gpu` extra).
    """
    try:
        import cupy
    except ImportError:
        raise BackendUnavailableError("gpu", "cupy", "gpu") from None
    return cupy


_MEMCPY_DEFAULT = 4
"""cudaMemcpyDefault: the direction is inferred from the pointers (unified virtual addressing)."""


def ready_event(buf: Any) -> Any:
    """For a device buffer, an event recorded now on the calling thread's current stream of the
    buffer's device, which completes once the work enqueued so far (what wrote `buf`) has; None
    for a host buffer."""
    if not is_device(buf):
        return None
    cp = cupy()
    with buf.device:
        event = cp.cuda.Event(disable_timing=True)
        event.record()
    return event


def pointer(buf: Any) -> int:
    """The address of a buffer's first byte, host or device."""
    if is_device(buf):
        return int(buf.data.ptr)
    return int(buf.ctypes.data)


def copy_bytes(target: Any, source: Any, after: Iterable[Any] = ()) -> None:
    """Copy `source`'s bytes into `target` (the same byte size; either may be host or device
    memory) once every event of `after` (None entries skipped) has completed, and return only
    when the copy has finished on the GPU."""
    cp = cupy()
    for event in after:
        if event is not None:
            event.synchronize()
    nbytes = target.nbytes
    if nbytes == 0:
        return
    device = target.device if is_device(target) else source.device
    with device:
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(pointer(target), pointer(source), nbytes, _MEMCPY_DEFAULT, stream.ptr)
        stream.synchronize()


def scratch_like(target: Any) -> Any:
    """An uninitialised device array of `target`'s size and dtype on its device."""
    cp = cupy()
    with target.device:
        return cp.empty(target.size, dtype=target.dtype)


def synchronize(buf: Any) -> None:
    """Wait until the work enqueued so far on the calling thread's current stream of `buf`'s
    device (kernels reading or writing it) has finished."""
    with buf.device:
        cupy().cuda.get_current_stream().synchronize()
