"""The GPU runtime: every CuPy call that moves or orders device memory, in one place.

Buffers with `__cuda_array_interface__` (CuPy arrays) stay on their device from the caller's
input to the result. What that needs from CUDA is small, and all of it is here:

* ordering: an event recorded on the caller's current stream when a buffer is handed over
  (`ready`), so that the kernels that produced it (or still read it) finish before a copy touches
  it; a stream that waits for such an event (`wait`);
* copies between any two buffers, device or host, on a transfer stream of this thread, finished
  on the GPU before the call returns (`copy`, `call_after`): a request that completes is done,
  never merely enqueued;
* pinned host memory for staging device data through host transports (`pinned`);
* allocation on a buffer's own device (`empty`) and the array module (`module`);
* which GPU a launched rank uses (`default_device`: COLLECTIVES_DEVICE, else its local rank), and
  making it current (`use_local_device`).

CuPy is imported on first use, so `import collectives` needs only numpy, and a device array
while CuPy is missing is a `BackendUnavailableError` naming the `gpu` extra.

The active runtime is a module-level object (`runtime()`); `use_runtime` replaces it. The CPU
tests install a fake runtime whose "device arrays" are numpy arrays that carry
`__cuda_array_interface__`, so that staging, ordering and error paths run where there is no GPU.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from .errors import BackendUnavailableError
from .seam import Seam

Event = Any
"""A point in a stream's work (`cupy.cuda.Event`), or None where there is nothing to wait for."""


def is_device(x: Any) -> bool:
    """Whether `x` is a device array (has `__cuda_array_interface__`).

    Numpy and CuPy arrays answer from their type: CuPy builds the whole interface dict to answer
    `hasattr`, and a collective asks a dozen times. Any other type is asked for the attribute
    itself, since some (torch's CPU tensors) have the property and raise from it.
    """
    kind = type(x)
    if kind is np.ndarray:
        return False
    cupy = sys.modules.get("cupy")
    if cupy is not None and kind is cupy.ndarray:
        return True
    return hasattr(x, "__cuda_array_interface__")


def cupy_module() -> ModuleType:
    """CuPy, imported on first use.

    Raises:
        BackendUnavailableError: CuPy is not installed (the `gpu` extra).
    """
    try:
        import cupy
    except ImportError:
        raise BackendUnavailableError("gpu", "cupy", "gpu") from None
    return cupy


def gpu_unavailable_reason() -> str | None:
    """Why device arrays cannot be used in this process (CuPy missing, or no GPU), or None."""
    try:
        cupy = cupy_module()
    except BackendUnavailableError as error:
        return str(error)
    try:
        available = cupy.cuda.is_available()
    except Exception as error:  # noqa: BLE001 - a broken driver install is a reason like any other
        return f"CuPy cannot reach the CUDA driver: {error!r}"
    if not available:
        return "CuPy finds no CUDA GPU (cupy.cuda.is_available() is False); the GPU path needs an NVIDIA GPU and driver"
    return None


ENV_DEVICE = "COLLECTIVES_DEVICE"
"""The GPU this rank uses (a CUDA device number); default: the local rank (modulo the GPUs seen)."""

_LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
"""Where launchers say which of a node's ranks this process is (ours, Open MPI, MPICH, Slurm)."""


def default_device(environ: Mapping[str, str], device_count: int) -> int:
    """COLLECTIVES_DEVICE if set, else the local rank the launcher gave (modulo the GPUs), else 0.

    Raises:
        ValueError: COLLECTIVES_DEVICE is not a device number below `device_count`.
    """
    explicit = environ.get(ENV_DEVICE)
    if explicit:
        if not explicit.isdigit() or int(explicit) >= device_count:
            raise ValueError(f"{ENV_DEVICE}={explicit!r} is not a GPU of this machine (it has {device_count})")
        return int(explicit)
    for name in _LOCAL_RANK_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value) % max(device_count, 1)
    return 0


def use_local_device(environ: Mapping[str, str] = os.environ) -> int:
    """Make this rank's GPU (`default_device`) the calling thread's current CuPy device, as a
    launched rank's script should before it makes device arrays; returns its number.

    Raises:
        BackendUnavailableError: CuPy is not installed.
    """
    cuda = cupy_module().cuda
    device = default_device(environ, int(cuda.runtime.getDeviceCount()))
    cuda.Device(device).use()
    return device


class Runtime(Protocol):
    """What the library asks of the GPU; `CupyRuntime` is the real one."""

    @property
    def module(self) -> ModuleType:
        """The array module of device arrays (cupy)."""
        ...

    def empty(self, shape: int | tuple[int, ...], dtype: Any, like: Any) -> Any:
        """An uninitialised device array on `like`'s device."""
        ...

    def ready(self, buf: Any) -> Event:
        """An event recorded now on the current stream of `buf`'s device (None for a host buffer)."""
        ...

    def wait(self, event: Event, like: Any) -> None:
        """Make the current stream of `like`'s device wait for `event` (nothing for None)."""
        ...

    def copy(self, dst: Any, src: Any, after: Sequence[Event]) -> None:
        """Copy `src` into `dst` (same byte size, either on host or device) once `after` have
        happened; return when the copy has finished."""
        ...

    def call_after(self, function: Callable[[], None], like: Any, after: Sequence[Event]) -> None:
        """Run `function` (which enqueues kernels) on a stream of `like`'s device that waits for
        `after`; return when its work has finished."""
        ...

    def same_device(self, a: Any, b: Any) -> bool:
        """Whether two device arrays live on the same device."""
        ...

    def synchronize(self, like: Any) -> None:
        """Return when the work queued so far on the current stream of `like`'s device has finished."""
        ...

    def pinned(self, nbytes: int) -> np.ndarray:
        """A page-locked host buffer of `nbytes` bytes (uint8), for fast device <-> host copies."""
        ...

    def model(self, like: Any) -> str:
        """The kind of GPU holding `like`, as its name and memory say ("NVIDIA H100 80GB HBM3,
        79 GiB"): what a measurement on it is valid for."""
        ...


class CupyRuntime:
    """The runtime over CuPy (>= 13).

    Copies run on one non-blocking transfer stream per thread and device, ordered after the
    events they are given and synchronized before returning: the threads backend calls them from
    whichever rank's thread completes a match, and a request must be done when it completes.
    """

    def __init__(self) -> None:
        self._cupy = cupy_module()
        self._streams = threading.local()

    @property
    def module(self) -> ModuleType:
        return self._cupy

    def empty(self, shape: int | tuple[int, ...], dtype: Any, like: Any) -> Any:
        with self._cupy.cuda.Device(like.device.id):
            return self._cupy.empty(shape, dtype=dtype)

    def ready(self, buf: Any) -> Event:
        if not is_device(buf):
            return None
        cuda = self._cupy.cuda
        with cuda.Device(buf.device.id):
            event = cuda.Event(block=False, disable_timing=True)
            event.record(cuda.get_current_stream())
        return event

    def wait(self, event: Event, like: Any) -> None:
        if event is None:
            return
        cuda = self._cupy.cuda
        with cuda.Device(like.device.id):
            cuda.get_current_stream().wait_event(event)

    def copy(self, dst: Any, src: Any, after: Sequence[Event]) -> None:
        nbytes = dst.nbytes
        if nbytes == 0:
            return
        runtime = self._cupy.cuda.runtime
        device = dst if is_device(dst) else src
        with self._cupy.cuda.Device(device.device.id):
            stream = self._transfer_stream()
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            runtime.memcpyAsync(_pointer(dst), _pointer(src), nbytes, runtime.memcpyDefault, stream.ptr)
            stream.synchronize()

    def call_after(self, function: Callable[[], None], like: Any, after: Sequence[Event]) -> None:
        with self._cupy.cuda.Device(like.device.id):
            stream = self._transfer_stream()
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            with stream:
                function()
            stream.synchronize()

    def same_device(self, a: Any, b: Any) -> bool:
        return bool(a.device.id == b.device.id)

    def synchronize(self, like: Any) -> None:
        cuda = self._cupy.cuda
        with cuda.Device(like.device.id):
            cuda.get_current_stream().synchronize()

    def pinned(self, nbytes: int) -> np.ndarray:
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        memory = self._cupy.cuda.alloc_pinned_memory(nbytes)  # what cupyx.empty_pinned wraps
        return np.frombuffer(memory, dtype=np.uint8, count=nbytes)

    def model(self, like: Any) -> str:
        properties = self._cupy.cuda.runtime.getDeviceProperties(like.device.id)
        name = properties["name"]
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        return f"{name}, {round(properties['totalGlobalMem'] / (1 << 30))} GiB"

    def _transfer_stream(self) -> Any:
        """This thread's transfer stream of the current device (made on first use)."""
        cuda = self._cupy.cuda
        device = cuda.Device().id
        streams: dict[int, Any] = self._streams.__dict__.setdefault("by_device", {})
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = cuda.Stream(non_blocking=True)
        return stream


def _pointer(buf: Any) -> int:
    """The address of a buffer's first byte, on the device or on the host."""
    if isinstance(buf, np.ndarray) and not is_device(buf):
        return int(buf.ctypes.data)
    return int(buf.__cuda_array_interface__["data"][0])


_RUNTIME: Seam[Runtime] = Seam(CupyRuntime)


def runtime() -> Runtime:
    """The active runtime: CuPy's, made on first use.

    Raises:
        BackendUnavailableError: CuPy is not installed.
    """
    return _RUNTIME.get()


def copy_after_queued(dst: Any, src: Any) -> None:
    """Copy `src` into `dst` (either or both device memory) once the kernels queued so far on the
    current stream of each device side have run, and return when the copy has finished. That
    stream may still use the memory: a caller's buffer being computed, or memory the allocator has
    just handed out again (freed memory is reused at once, safely only on the freeing stream)."""
    gpu = runtime()
    gpu.copy(dst, src, (gpu.ready(dst), gpu.ready(src)))


def use_runtime(replacement: Runtime | None) -> Runtime | None:
    """Make `replacement` the active runtime (None: CuPy's again, on next use); returns the one it
    replaces. The seam through which tests run the device paths on a fake GPU."""
    return _RUNTIME.replace(replacement)
