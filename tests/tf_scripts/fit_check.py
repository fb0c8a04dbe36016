"""`model.fit` checks, run on every rank of a real job (launcher or mpiexec).

For each case every rank starts from a model of its own (different on purpose), compiles it with
`DistributedOptimizer`, and fits its own slice of each global batch with
`BroadcastGlobalVariablesCallback` and `MetricAverageCallback`; rank-local state then has to match
a reference trained in this process on the whole global batches. Checked: the variables match the
reference to float32 tolerance and are bit-identical on every rank, and the epoch logs are the same
on every rank. Prints "rank R: CASE ok" per passed case; exits non-zero otherwise.

Cases: fit-eager and fit-graph (`run_eagerly=True` / the compiled step; reference: plain `fit` on
the global batches), sparse (an embedding, compiled), accumulate (`backward_passes_per_step=2`,
averaged, compiled) and accumulate-sum (summed, eager), whose reference accumulates gradients by
hand over two global batches per step.

    python -m collectives.launch -n 2 tests/tf_scripts/fit_check.py fit-eager fit-graph accumulate
    mpiexec -n 2 python tests/tf_scripts/fit_check.py sparse accumulate-sum
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf
from train_check import BATCH_PER_RANK, batches, check_identical_everywhere, dense_model, embedding_model, run_cases

import collectives
from collectives.strategies import BroadcastGlobalVariablesCallback, DistributedOptimizer, MetricAverageCallback

PASSES = 2


def sgd() -> keras.optimizers.Optimizer:
    """With momentum, so that a step also depends on the optimizer's state."""
    return keras.optimizers.SGD(0.1, momentum=0.9)


def compile_model(model: keras.Model, optimizer: keras.optimizers.Optimizer, eager: bool) -> None:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"], run_eagerly=eager)


def fit_reference(model: keras.Model, data, eager: bool) -> None:
    """One process, a plain optimizer, `fit` on the whole global batches."""
    compile_model(model, sgd(), eager)
    x, y = (np.concatenate(parts) for parts in zip(*data))
    model.fit(x, y, batch_size=len(data[0][0]), shuffle=False, verbose=0)


def accumulate_by_hand(model: keras.Model, data, average: bool) -> None:
    """One process, a plain optimizer stepping on the sum (or mean) of `PASSES` global batches' gradients."""
    optimizer = sgd()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for start in range(0, len(data), PASSES):
        total = [tf.zeros_like(v) for v in model.trainable_variables]
        for x, y in data[start : start + PASSES]:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            total = [t + tf.convert_to_tensor(g) for t, g in zip(total, tape.gradient(loss, model.trainable_variables))]
        optimizer.apply([t / PASSES if average else t for t in total], model.trainable_variables)


def check_case(comm: collectives.Communicator, case: str) -> None:
    sparse = case == "sparse"
    eager = case in ("fit-eager", "accumulate-sum")
    build = embedding_model if sparse else dense_model
    data = batches(sparse, BATCH_PER_RANK * comm.size)
    mine = slice(comm.rank * BATCH_PER_RANK, (comm.rank + 1) * BATCH_PER_RANK)
    passes = PASSES if case.startswith("accumulate") else 1
    average = case == "accumulate"

    model = build(seed=comm.rank)  # different on purpose: the broadcast callback must fix it
    optimizer = DistributedOptimizer(
        sgd(), comm=comm, bucket_bytes=256, backward_passes_per_step=passes, average_aggregated_gradients=average
    )
    compile_model(model, optimizer, eager)
    x, y = (np.concatenate([part[mine] for part in parts]) for parts in zip(*data))
    callbacks = [BroadcastGlobalVariablesCallback(0, comm=comm), MetricAverageCallback(comm=comm)]
    history = model.fit(x, y, batch_size=BATCH_PER_RANK, shuffle=False, verbose=0, callbacks=callbacks)
    if int(optimizer.iterations) != len(data) // passes:
        raise AssertionError(f"{case}: {int(optimizer.iterations)} optimizer steps, expected {len(data) // passes}")

    weights = [v.numpy() for v in model.trainable_variables]
    check_identical_everywhere(comm, weights, case)
    logs = np.array([history.history[name][-1] for name in sorted(history.history)], np.float64)
    check_identical_everywhere(comm, [logs], f"{case} epoch logs")

    reference = build(seed=0)
    if passes == 1:
        fit_reference(reference, data, eager)
    else:
        accumulate_by_hand(reference, data, average)
    for got, want, variable in zip(weights, reference.trainable_variables, model.trainable_variables):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"{case}: {variable.path}")


if __name__ == "__main__":
    sys.exit(run_cases(sys.argv[1:], check_case))
