"""Train a small CNN data-parallel with Keras's `model.fit`: `DistributedOptimizer` and the callbacks.

Runs on one rank as it is, or on several:

    python examples/keras_fit.py                                     # 1 rank
    python -m collectives.launch -n 2 examples/keras_fit.py          # 2 ranks over gRPC
    mpiexec -n 2 python examples/keras_fit.py                        # 2 ranks over MPI

The model and the generated data are those of examples/train_keras.py (the custom-loop version);
every rank fits its own shard of the samples. The learning rate is scaled by the number of ranks
and warmed up to it over the first epoch; only rank 0 prints progress and writes checkpoints.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras

import collectives
from collectives.examples.train_keras import build_model, synthetic_digits  # the sibling example
from collectives.strategies import (
    BroadcastGlobalVariablesCallback,
    DistributedOptimizer,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-per-rank", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--backward-passes-per-step", type=int, default=1, help="batches summed before each exchange")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "keras_fit.keras"))
    args = parser.parse_args()

    comm = collectives.init()
    images, labels = synthetic_digits(args.samples)
    shard = slice(comm.rank * (args.samples // comm.size), (comm.rank + 1) * (args.samples // comm.size))
    images, labels = images[shard], labels[shard]  # equal shards: every rank runs the same number of steps

    model = build_model(seed=comm.rank)  # any start: the broadcast callback gives every rank rank 0's
    optimizer = DistributedOptimizer(
        keras.optimizers.Adam(1e-3 * comm.size),  # the single-rank rate scaled by the number of ranks
        backward_passes_per_step=args.backward_passes_per_step,
        average_aggregated_gradients=True,
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])

    callbacks: list[keras.callbacks.Callback] = [
        BroadcastGlobalVariablesCallback(root_rank=0),  # every rank starts from rank 0's weights
        MetricAverageCallback(),  # the logs are the ranks' mean: every rank sees the same metrics
        LearningRateWarmupCallback(warmup_epochs=1, verbose=1 if comm.rank == 0 else 0),
    ]
    if comm.rank == 0:  # one writer: the ranks hold identical weights
        callbacks.append(keras.callbacks.ModelCheckpoint(args.checkpoint))

    model.fit(
        images,
        labels,
        batch_size=args.batch_per_rank,
        epochs=args.epochs,
        callbacks=callbacks,
        verbose=1 if comm.rank == 0 else 0,
    )
    if comm.rank == 0:
        print(f"checkpoint: {args.checkpoint} (keras.models.load_model gives back the model and a plain Adam)")
    comm.close()


if __name__ == "__main__":
    main()
