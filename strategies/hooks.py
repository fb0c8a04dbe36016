"""Eager-mode gradient hooks: hand each variable's gradient over the moment backprop computes it.

In eager mode `tape.gradient` computes every gradient in one call and returns them all at the
end, which is why Horovod and `tf.distribute` cannot start communicating before backprop is over.
Here each trainable variable is read once, at the start of the forward pass, through an identity
op with a custom gradient; TensorFlow calls that gradient function during `tape.gradient`, as soon
as the variable's gradient is complete, and the function hands the gradient to a callback (which
copies it into its bucket and may start the bucket's all-reduce) before backprop continues.

The reads are substituted with Keras 3's `StatelessScope`, the mechanism Keras itself uses for
stateless calls: inside it, every read of a mapped `keras.Variable` returns the hooked tensor.
Variable updates made inside the forward pass (BatchNorm statistics, random seeds) are recorded by
the scope and applied when it closes; losses the layers add (activity regularizers) are collected
by it, so `model.losses` holds them inside the `with tape:` block, where the loss is computed.
Plain `tf.Variable`s cannot be redirected; for those the tape falls back to aggregating after
backprop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ._tensorflow import tensorflow


def hookable(variables: Sequence[Any]) -> bool:
    """Whether every variable is a Keras 3 variable (whose reads a StatelessScope redirects)."""
    import keras

    return bool(variables) and all(isinstance(v, keras.Variable) for v in variables)


class GradientHooks:
    """Identity ops on `variables` whose gradient functions call `on_gradient(index, gradient)`."""

    def __init__(self, variables: Sequence[Any], on_gradient: Callable[[int, Any], None]) -> None:
        self.variables = list(variables)
        self._identities = [self._identity(index, on_gradient) for index in range(len(self.variables))]

    @staticmethod
    def _identity(index: int, on_gradient: Callable[[int, Any], None]) -> Callable[[Any], Any]:
        tf = tensorflow()

        @tf.custom_gradient
        def identity(value):
            def gradient(upstream):
                on_gradient(index, upstream)
                return upstream

            return tf.identity(value), gradient

        return identity

    @contextlib.contextmanager
    def reading_through_hooks(self) -> Iterator[None]:
        """Within this block, every read of the variables goes through its hook."""
        import keras

        class ApplyingScope(keras.StatelessScope):
            """Records the variables assigned inside, so that their updates can be applied."""

            def __init__(self, state_mapping: list[tuple[Any, Any]]) -> None:
                # losses added in the forward pass (activity regularizers) are kept: without
                # collect_losses a stateless scope drops them, and `model.losses` came back empty
                super().__init__(state_mapping=state_mapping, collect_losses=True)
                self.updated: dict[int, Any] = {}

            def add_update(self, update: tuple[Any, Any]) -> None:
                super().add_update(update)
                self.updated[id(update[0])] = update[0]

        scope = ApplyingScope([(v, hook(v.value)) for v, hook in zip(self.variables, self._identities)])
        with scope:
            yield
        for variable in scope.updated.values():
            variable.assign(scope.get_current_value(variable))
