"""Runnable examples of the library (also importable, as `collectives.examples`, for the model and data
that `collectives.bench.tf_compare` trains)."""
