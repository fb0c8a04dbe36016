"""Which array library a buffer belongs to: numpy for host memory, CuPy for GPU memory.

A collective given a CuPy array keeps it on its device end to end: the result, the scratch and
every reduction are CuPy arrays on the input's device, and no algorithm calls numpy on a device
array (numpy would either refuse it or copy it to the host behind the caller's back). So every
place that allocates, copies or compares buffers on the caller's behalf asks here, with the
caller's array in hand, which module to use.

A device array is any object with `__cuda_array_interface__` (CuPy's, or one from another library
such as a DLPack-converted TensorFlow tensor, which CuPy wraps without a copy). CuPy is imported on
the first device array, so numpy-only users never import it; without it, a device array is a
`BackendUnavailableError` naming the `gpu` extra.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from collectives.backends.device import cupy, is_device

__all__ = ["array_module", "as_device_array", "cupy", "empty_like_kind", "is_device", "may_share_memory", "same_device"]


def array_module(array: Any) -> ModuleType:
    """`cupy` for a device array, else `numpy`."""
    return cupy() if is_device(array) else np


def as_device_array(array: Any) -> Any:
    """A device array as a CuPy array (the same memory: CuPy wraps foreign device arrays without a copy)."""
    xp = cupy()
    return array if isinstance(array, xp.ndarray) else xp.asarray(array)


def empty_like_kind(like: Any, shape: int | tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised array of `shape` and `dtype` in the memory `like` lives in (its GPU, for a
    device array)."""
    if not is_device(like):
        return np.empty(shape, dtype=dtype)
    xp = cupy()
    with like.device:
        return xp.empty(shape, dtype=dtype)


def may_share_memory(a: Any, b: Any) -> bool:
    """Whether `a` and `b` may overlap: never when one is on the host and the other on a device."""
    device_a, device_b = is_device(a), is_device(b)
    if device_a != device_b:
        return False
    if device_a:
        return bool(cupy().may_share_memory(a, b))
    return bool(np.may_share_memory(a, b))


def same_device(a: Any, b: Any) -> bool:
    """Whether two arrays live in the same memory: both on the host, or both on one GPU."""
    if is_device(a) != is_device(b):
        return False
    return not is_device(a) or a.device.id == b.device.id
