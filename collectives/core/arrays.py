"""Which array module a buffer belongs to, and the few array calls that must follow it.

A collective's buffers are numpy arrays or device arrays (CuPy, anything with
`__cuda_array_interface__`), and everything derived from them (outputs, scratch, work space)
must live where the input lives: numpy called on a device array would copy it to the host, or
fail. The call sites ask here instead of calling numpy directly. A plain numpy array is
recognised by its exact type first, so the host path pays one comparison.

CuPy itself is imported by `collectives.backends.device` on first use; a device array while CuPy is
missing raises `BackendUnavailableError` naming the `gpu` extra.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from collectives.backends.base import Transport
from collectives.backends.device import is_device, runtime

__all__ = ["array_module", "ascontiguous", "empty", "is_device", "may_share_memory", "scratch"]


def array_module(x: Any) -> ModuleType:
    """cupy for a device array, numpy for anything else.

    Raises:
        BackendUnavailableError: `x` is a device array and CuPy is not installed.
    """
    if is_device(x):
        return runtime().module
    return np


def empty(shape: int | tuple[int, ...], dtype: Any, like: Any) -> Any:
    """An uninitialised array where `like` lives (numpy, or `like`'s device)."""
    if is_device(like):
        return runtime().empty(shape, dtype, like)
    return np.empty(shape, dtype=dtype)


def scratch(transport: Transport, count: int, like: Any) -> Any:
    """`count` items of `like`'s dtype for receiving into: on `like`'s device for a device array,
    else from the transport (whose `empty` may charge or elide memory, as the simulator's does)."""
    if is_device(like):
        return runtime().empty(count, like.dtype, like)
    return transport.empty(count, like.dtype)


def ascontiguous(x: Any) -> Any:
    """`x` itself if C-contiguous, else a contiguous copy in the same module."""
    return array_module(x).ascontiguousarray(x)


def may_share_memory(a: Any, b: Any) -> bool:
    """Whether two arrays may overlap; a host and a device array never do."""
    a_device, b_device = is_device(a), is_device(b)
    if a_device != b_device:
        return False
    return bool(array_module(a).may_share_memory(a, b))
