"""Data-parallel training checks, run on every rank of a real job (launcher or mpiexec).

For each case, every rank trains the same model on its own slice of each global batch through
`DistributedGradientTape`, and rank 0 also trains a second copy alone on the whole global batch.
Checked: the distributed variables match the single-process ones to float32 tolerance, are
bit-identical on every rank, and a `tf.function` step is traced once, not once per step. Prints
"rank R: CASE ok" per passed case; exits non-zero otherwise.

    python -m collectives.launch -n 2 tests/tf_scripts/train_check.py eager graph sparse fp16 overlap-eager
    mpiexec -n 2 python tests/tf_scripts/train_check.py mismatch
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

import collectives
from collectives.strategies import (
    Compression,
    DistributedGradientTape,
    broadcast_variables,
    hidden_fraction,
    load_trace,
)

BATCH_PER_RANK = 8
STEPS = 4


def dense_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])


def embedding_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )


def batches(sparse: bool, global_batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    x = (
        rng.integers(0, 50, (STEPS, global_batch, 4)).astype(np.int32)
        if sparse
        else rng.normal(size=(STEPS, global_batch, 6)).astype(np.float32)
    )
    y = rng.integers(0, 3, (STEPS, global_batch)).astype(np.int32)
    return list(zip(x, y))


def train(model: keras.Model, data, tape_factory, graph: bool) -> None:
    optimizer = keras.optimizers.SGD(0.5)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tape = tape_factory()

    def step(x, y):
        with tape:
            loss = loss_fn(y, model(x))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))

    run = tf.function(step) if graph else step
    for x, y in data:
        run(tf.constant(x), tf.constant(y))
    if graph and run.experimental_get_tracing_count() != 1:
        raise AssertionError(f"the training step was traced {run.experimental_get_tracing_count()} times, not once")


def check_identical_everywhere(comm: collectives.Communicator, arrays: list[np.ndarray], case: str) -> None:
    """Every rank holds bit-identical `arrays` (compared through a digest)."""
    digest = np.frombuffer(hashlib.sha256(b"".join(a.tobytes() for a in arrays)).digest(), np.uint8)
    digests = comm.allgather(digest).reshape(comm.size, -1)
    if not (digests == digests[0]).all():
        raise AssertionError(f"{case}: variables differ between ranks")


class PlainTape:
    """A reusable plain tape, the single-process reference."""

    def __enter__(self):
        self.tape = tf.GradientTape()
        return self.tape.__enter__()

    def __exit__(self, *exc):
        return self.tape.__exit__(*exc)

    def gradient(self, target, sources):
        return self.tape.gradient(target, sources)


def check_case(comm: collectives.Communicator, case: str) -> None:
    sparse, graph = case == "sparse", case == "graph"
    build = embedding_model if sparse else dense_model
    data = batches(sparse, BATCH_PER_RANK * comm.size)
    mine = slice(comm.rank * BATCH_PER_RANK, (comm.rank + 1) * BATCH_PER_RANK)
    model = build(seed=comm.rank)  # different on purpose: broadcast_variables must fix it
    broadcast_variables(model.variables, comm=comm)
    compression = Compression.fp16 if case == "fp16" else None
    train(
        model,
        [(x[mine], y[mine]) for x, y in data],
        lambda: DistributedGradientTape(comm=comm, model=model, compression=compression, bucket_bytes=256),
        graph,
    )
    weights = [v.numpy() for v in model.trainable_variables]
    check_identical_everywhere(comm, weights, case)
    reference = build(seed=0)
    train(reference, data, PlainTape, graph)
    tolerance = 2e-3 if compression else 1e-5
    for got, want, variable in zip(weights, reference.trainable_variables, model.trainable_variables):
        np.testing.assert_allclose(
            got, want.numpy(), rtol=tolerance, atol=tolerance, err_msg=f"{case}: {variable.path}"
        )


def check_mismatch(comm: collectives.Communicator) -> None:
    """Rank 1 has a wider layer: every rank must raise MismatchError naming it, not hang."""
    keras.utils.set_random_seed(0)
    width = 17 if comm.rank == 1 else 16
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(width), keras.layers.Dense(3)])
    tape = DistributedGradientTape(comm=comm, model=model)
    with tape:
        loss = tf.reduce_sum(model(tf.ones((2, 6))))
    try:
        tape.gradient(loss, model.trainable_variables)
    except collectives.MismatchError as error:
        if "entry 0" not in str(error) or "(6, 16)" not in str(error) or "(6, 17)" not in str(error):
            raise AssertionError(f"unhelpful mismatch message: {error}") from error
        return
    raise AssertionError("no MismatchError for different models")


def check_overlap(comm: collectives.Communicator, graph: bool) -> None:
    """In the timeline of a step after the first, the first bucket's all-reduce starts before
    backprop ends. Small buckets, so that bucket 0 holds only the last layer, whose gradients
    come first (TensorFlow's executor may compute a layer's weight gradient late)."""
    trace = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"collectives-overlap-{os.getppid()}-{graph}-{{rank}}.json")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16, 16, 8)),
            *[keras.layers.Conv2D(32, 3, padding="same", activation="relu") for _ in range(4)],
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    # 6 steps: 5 chances after the first, since on a loaded machine TensorFlow's executor
    # sometimes runs bucket 0 just after backprop ends (2 chances failed CI once)
    data = [(np.ones((64, 16, 16, 8), np.float32), np.zeros(64, np.int32))] * 6
    tape_factory = lambda: DistributedGradientTape(comm=comm, model=model, bucket_bytes=2 << 10, timeline=trace)  # noqa: E731
    train(model, data, tape_factory, graph)
    events = [e for e in load_trace(trace.format(rank=comm.rank)) if e["ph"] == "X"]  # spans, not metadata
    os.remove(trace.format(rank=comm.rank))
    steps = sorted({e["args"]["step"] for e in events})
    last = steps[-1]

    def spans(step: int) -> tuple[dict, dict]:
        backprop = next(e for e in events if e["cat"] == "backprop" and e["args"]["step"] == step)
        return backprop, next(e for e in events if e["name"] == "bucket 0" and e["args"]["step"] == step)

    later = [spans(step) for step in steps[1:]]  # one late start on a loaded machine is not a failure
    if not any(bucket["ts"] < backprop["ts"] + backprop["dur"] for backprop, bucket in later):
        raise AssertionError(f"bucket 0 started after backprop ended in every step after the first: {later}")
    print(
        f"rank {comm.rank}: hidden fraction {'graph' if graph else 'eager'} {hidden_fraction(events, last):.2f}",
        flush=True,
    )


def check(comm: collectives.Communicator, case: str) -> None:
    if case == "mismatch":
        check_mismatch(comm)
    elif case.startswith("overlap"):
        check_overlap(comm, graph=case == "overlap-graph")
    else:
        check_case(comm, case)


def run_cases(cases: list[str], check: Callable[[collectives.Communicator, str], None]) -> int:
    """`check(comm, case)` for every case, printing "rank R: CASE ok" after each."""
    comm = collectives.init(timeout=60)
    for case in cases:
        check(comm, case)
        print(f"rank {comm.rank}: {case} ok", flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_cases(sys.argv[1:], check))
