"""The one place that imports TensorFlow, so a missing install gives a clear error naming the
extra to install instead of an ImportError from deep inside."""

from __future__ import annotations

import functools
from types import ModuleType

from backends.errors import BackendUnavailableError


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
