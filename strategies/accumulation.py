"""`LocalAccumulation`: sum gradients over N backward passes before they are exchanged.

With `backward_passes_per_step=N` (Horovod's name) each rank adds the gradients of N local
micro-batches into variables of its own and the ranks exchange and apply them only on every N-th
pass: N times less communication, and the effective batch is N times larger without the memory of
a larger batch. The sums live in plain `tf.Variable`s held here, outside the optimizer's tracked
state, so a checkpoint of the optimizer is the same with and without accumulation (a partly
accumulated step is not saved, as in Horovod).

Sparse gradients (`tf.IndexedSlices`) are added into dense accumulators, so they travel dense.
A variable that got no gradient in any pass of the step is handed on as None, as it would be
without accumulation: a zero sum would let weight decay shrink it and momentum move it. Eagerly
each pass is looked at; in a `tf.function` which gradients are None is fixed when it is traced, so
the N-th pass's say.
Everything is written in TensorFlow ops (`tf.cond` on a pass counter), so one code path runs
eagerly and inside `tf.function`; every rank counts the same passes, so every rank takes the same
branch and the collectives inside it line up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._tensorflow import tensorflow


class LocalAccumulation:
    """Per-variable gradient sums and a pass counter.

    Args:
        passes: backward passes per optimizer step (at least 1).
        average: divide the sums by `passes` before they are handed on, so the step uses the mean
            of the micro-batch gradients instead of their sum (Horovod's
            `average_aggregated_gradients`).
    """

    def __init__(self, passes: int, average: bool) -> None:
        if isinstance(passes, bool) or not isinstance(passes, int):
            raise TypeError(f"backward_passes_per_step must be an int, got {passes!r}")
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be at least 1, got {passes}")
        self.passes = passes
        self.average = average
        self._variables: list[Any] = []
        self._sums: list[Any] = []
        self._counter: Any = None
        self._received: set[int] = set()
        """Eagerly: the variables that got a gradient in a pass of the step so far."""

    def build(self, variables: Sequence[Any]) -> None:
        """Make one zeroed sum per variable (outside any `tf.function`, whose graphs cannot
        create variables after their first trace)."""
        tf = tensorflow()
        self._variables = list(variables)
        with tf.init_scope():
            self._sums = [
                tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name="accumulated_gradient") for v in variables
            ]
            self._counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="accumulated_passes")

    @property
    def built(self) -> bool:
        return self._counter is not None

    def add(
        self, gradients: Sequence[Any], variables: Sequence[Any] | None, apply: Callable[[list[Any]], None]
    ) -> None:
        """Add `gradients` (of `variables`, which must be the built ones in the same order; None
        means those; a None gradient adds nothing) to the sums; on every `passes`-th call hand the
        sums (averaged if `average`) to `apply` and zero them."""
        tf = tensorflow()
        if variables is not None and [id(v) for v in variables] != [id(v) for v in self._variables]:
            raise ValueError(
                "backward_passes_per_step > 1 needs the gradients of all the variables the optimizer was "
                f"built with, in the same order: got {len(variables)} variables for {len(self._variables)}"
            )
        if len(gradients) != len(self._sums):
            raise ValueError(f"got {len(gradients)} gradients for {len(self._sums)} accumulated variables")
        updates = [
            total.assign_add(tf.convert_to_tensor(gradient))
            for total, gradient in zip(self._sums, gradients)
            if gradient is not None
        ]
        with tf.control_dependencies(updates):
            count = self._counter.assign_add(1)
        eager = tf.executing_eagerly()
        given = {index for index, gradient in enumerate(gradients) if gradient is not None}
        if eager:
            self._received |= given
        received = self._received if eager else given

        def step() -> Any:
            # Inside tf.function stateful ops run in program order: the sums are read by `apply`
            # before they are zeroed.
            sums = [total.read_value() if index in received else None for index, total in enumerate(self._sums)]
            if self.average:
                sums = [None if total is None else total / tf.cast(self.passes, total.dtype) for total in sums]
            apply(sums)
            for total in self._sums:
                total.assign(tf.zeros_like(total))
            self._counter.assign(0)
            if eager:
                self._received = set()
            return tf.constant(True)

        tf.cond(tf.equal(count, self.passes), step, lambda: tf.constant(False))
