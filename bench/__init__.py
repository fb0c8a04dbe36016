"""Benchmarks: `python -m bench` (nccl-tests style table) and the pytest-benchmark suite."""
