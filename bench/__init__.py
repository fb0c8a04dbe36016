"""Benchmarks: the `python -m bench` sweep (nccl-tests style), the training-efficiency model
(`python -m bench scaling`) and the pytest-benchmark suite (`pytest bench/ --benchmark-only`).

Modules: `cli` (options and their checks), `commands` (what each command does), `run` (threads here
or launched processes), `measure` (the timing loop), `payloads` (exact inputs and results), `output`
(table, CSV, JSON), `progress` (the progress bar), `plots`, `scaling` (the efficiency model),
`simulated` (the selector's regret table).
"""
