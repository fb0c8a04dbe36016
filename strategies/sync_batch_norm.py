"""`SyncBatchNormalization`: batch normalization over the global batch, as Horovod's.

With small per-rank batches the batch statistics of one rank are noisy; this layer normalizes with
the mean and variance of the whole global batch instead. In training each rank sums its inputs,
their squares and their count per channel, and one all-reduce (sum) of the three gives the global
statistics: mean = S / N, variance = Q / N - mean^2. Counts travel with the sums, so ranks may hold
batches of different sizes, even empty ones. The all-reduce has a gradient (`ops.allreduce`), so
backprop through the statistics reaches every rank's inputs as it would in one process on the
global batch. Inference uses the moving statistics, updated from the global ones, and
communicates nothing.
"""

from __future__ import annotations

from typing import Any

import keras

from collectives import Communicator

from ._tensorflow import tensorflow
from .ops import allreduce


@keras.saving.register_keras_serializable(package="collectives")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` whose training statistics span every rank's batch.

    Args:
        comm: the communicator; None means the one made by the last `collectives.init()` (not
            saved with the layer's config).
        **kwargs: those of `keras.layers.BatchNormalization` (`synchronized`, which asks
            `tf.distribute` to synchronize, is refused: this layer synchronizes itself).
    """

    def __init__(self, *, comm: Communicator | None = None, **kwargs: Any) -> None:
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization synchronizes over its communicator; leave synchronized unset")
        super().__init__(**kwargs)
        self._comm = comm

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        """Mean and variance per channel over every rank's batch (the base class's hook)."""
        tf = tensorflow()
        axes = self._reduction_axes
        if mask is None:
            weights = tf.ones_like(inputs)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)), inputs.dtype)
        local = tf.stack(
            [
                tf.reduce_sum(inputs * weights, axes),
                tf.reduce_sum(tf.square(inputs) * weights, axes),
                tf.reduce_sum(weights, axes),
            ]
        )
        total, total_squares, count = tf.unstack(allreduce(local, "sum", self._comm))
        count = tf.maximum(count, 1.0)  # no data anywhere: zeros rather than NaN
        mean = total / count
        variance = tf.maximum(total_squares / count - tf.square(mean), 0.0)
        return mean, variance
