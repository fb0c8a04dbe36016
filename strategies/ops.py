"""Collectives on TensorFlow tensors and variables: `allreduce`, `allgather`, `broadcast`,
`broadcast_variables`.

Eagerly, a tensor is handed to the communicator as the numpy array that shares its memory, and
the result, written into 64-byte aligned memory, becomes a tensor without a copy. Inside
`tf.function` each call becomes one stateful `tf.numpy_function` op; TensorFlow runs stateful ops
in program order, so every rank issues its collectives in the order the code calls them, which the
communicator requires.

A collective op occupies one of TensorFlow's inter-op threads until every rank has joined it. With
one rank per process (the normal case) that is harmless; ranks that are threads of one process
(the threads backend) share one pool, so tf.function collectives there need no more ranks than
the pool has threads (`tf.config.threading.set_inter_op_parallelism_threads`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from collectives import Communicator

from ._tensorflow import aligned_empty, as_array, as_tensor, communicator, tensorflow
from .aggregator import variable_name
from .fingerprint import check_same_everywhere, describe
from .uneven import allgather_rows


def allreduce(tensor: Any, op: str = "sum", comm: Communicator | None = None, *, algorithm: str = "auto") -> Any:
    """`tensor` reduced over all ranks with `op` (sum, mean, max, min, prod); same shape and dtype."""
    tf = tensorflow()
    comm = communicator(comm)
    tensor = tf.convert_to_tensor(tensor)
    return _apply(
        tf,
        lambda a: comm.allreduce(a, op=op, algorithm=algorithm, out=aligned_empty(a.shape, a.dtype)),
        tensor,
        tensor.shape,
        "collectives_allreduce",
    )


def allgather(tensor: Any, comm: Communicator | None = None) -> Any:
    """Every rank's `tensor` concatenated along the first axis in rank order (the first dimension
    may differ between ranks, as with Horovod's allgather)."""
    tf = tensorflow()
    comm = communicator(comm)
    tensor = tf.convert_to_tensor(tensor)
    shape = [None, *tensor.shape[1:]] if tensor.shape.rank else [None]
    return _apply(tf, lambda a: allgather_rows(comm, a), tensor, shape, "collectives_allgather")


def broadcast(tensor: Any, root: int = 0, comm: Communicator | None = None) -> Any:
    """Rank `root`'s `tensor`, on every rank."""
    tf = tensorflow()
    comm = communicator(comm)
    tensor = tf.convert_to_tensor(tensor)
    return _apply(
        tf,
        lambda a: comm.broadcast(a, root=root, out=aligned_empty(a.shape, a.dtype)),
        tensor,
        tensor.shape,
        "collectives_broadcast",
    )


def broadcast_variables(variables: Sequence[Any], root: int = 0, comm: Communicator | None = None) -> None:
    """Assign rank `root`'s values to `variables` on every rank (model weights and optimizer state,
    e.g. `model.variables + optimizer.variables`), so that training starts identical everywhere.

    The ranks first check they hold the same variables (names, shapes, dtypes, in order), then the
    values travel as one broadcast per dtype. Works eagerly and inside `tf.function`.

    Raises:
        MismatchError: the ranks' variables differ; names the first differing entry.
    """
    tf = tensorflow()
    comm = communicator(comm)
    variables = list(variables)
    if comm.size == 1 or not variables:
        return
    entries = tuple(describe(variable_name(v), tuple(v.shape), tf.as_dtype(v.dtype).name) for v in variables)
    by_dtype: dict[str, list[int]] = {}
    for index, variable in enumerate(variables):
        by_dtype.setdefault(tf.as_dtype(variable.dtype).name, []).append(index)

    def exchange(*values: np.ndarray) -> list[np.ndarray]:
        check_same_everywhere(comm, entries, "variables to broadcast (name, shape, dtype, in order)")
        results: list[np.ndarray] = [None] * len(values)  # type: ignore[list-item]
        for indices in by_dtype.values():
            flat = np.concatenate([np.asarray(values[i]).reshape(-1) for i in indices])
            received = comm.broadcast(flat, root=root)
            offset = 0
            for i in indices:
                count = int(np.prod(values[i].shape))
                results[i] = received[offset : offset + count].reshape(values[i].shape)
                offset += count
        return results

    values = [tf.convert_to_tensor(v) for v in variables]
    if tf.executing_eagerly():
        received = exchange(*(as_array(value) for value in values))
    else:
        received = tf.numpy_function(
            exchange, values, [value.dtype for value in values], stateful=True, name="collectives_broadcast_variables"
        )
    for variable, value in zip(variables, received):
        variable.assign(tf.reshape(value, variable.shape))  # a numpy_function's output has no static shape


def _apply(tf, function: Callable[[np.ndarray], np.ndarray], tensor: Any, shape: Any, name: str) -> Any:
    """Run a numpy collective on `tensor`: directly when eager, as a stateful op in a graph."""
    if tf.executing_eagerly():
        return as_tensor(function(as_array(tensor)))
    result = tf.numpy_function(function, [tensor], tensor.dtype, stateful=True, name=name)
    result.set_shape(shape)
    return result
