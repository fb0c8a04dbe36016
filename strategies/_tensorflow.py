"""The one place that imports TensorFlow, so a missing install gives a clear error naming the
extra to install instead of an ImportError from deep inside; and the conversions between tensors
and numpy arrays, which avoid copying large buffers (`tensor.numpy()` and `tf.convert_to_tensor`
each copy, which would cost more than the all-reduce itself on a fast link)."""

from __future__ import annotations

import functools
import math
from types import ModuleType
from typing import Any

import numpy as np

from collectives.backends.errors import BackendUnavailableError


@functools.cache
def tensorflow() -> ModuleType:
    """The `tensorflow` module, imported on first use."""
    try:
        import tensorflow as tf
    except ImportError:
        raise BackendUnavailableError("tensorflow", "tensorflow", "tf") from None
    return tf


def communicator(comm):
    """`comm`, or the communicator made by the last `collectives.init()` when it is None."""
    if comm is not None:
        return comm
    from collectives import default_communicator

    return default_communicator()


ALIGNMENT = 64
"""Bytes. TensorFlow's CPU tensors must start at a 64-byte boundary to be used without a copy."""

_ZERO_COPY_BYTES = 64 << 10
"""Below this, copying into a new tensor costs less than wrapping the array's memory."""


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts at an `ALIGNMENT`-byte boundary."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    raw = np.empty(count * dtype.itemsize + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + count * dtype.itemsize].view(dtype).reshape(shape)


def as_array(tensor: Any) -> np.ndarray:
    """A CPU tensor's memory as a read-only numpy array, without the copy `tensor.numpy()` makes."""
    return np.asarray(tensor)


def as_tensor(array: np.ndarray) -> Any:
    """A tensor holding `array`'s values: sharing its memory when it is large, contiguous and
    aligned (through DLPack), copied otherwise. The array must not be modified afterwards."""
    tf = tensorflow()
    if array.nbytes >= _ZERO_COPY_BYTES and array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)
