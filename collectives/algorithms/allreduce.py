"""`run_allreduce`: run a named all-reduce algorithm on a group.

The one place that maps algorithm names to code, shared by the `Communicator` and by whatever runs
algorithms on a bare `Group` (the simulator harness, the tuning pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from collectives.algorithms.hierarchical import hierarchical_allreduce_steps
from collectives.algorithms.reference import reference_allreduce_steps
from collectives.algorithms.ring import ring_allreduce_steps
from collectives.algorithms.tree import tree_allreduce_steps
from collectives.core.group import Group
from collectives.core.ops import ReduceOp
from collectives.core.schedule import Steps, drive

ALLREDUCE_ALGORITHMS = ("ring", "tree", "hierarchical", "hierarchical_tree", "reference")
"""The library's all-reduce algorithms; they run on every backend."""


def run_allreduce(
    algorithm: str,
    group: Group,
    nodes: Sequence[Sequence[int]],
    src: np.ndarray,
    dst: np.ndarray,
    op: ReduceOp,
    *,
    segment_bytes: int,
) -> None:
    """dst = op over all members of src with `algorithm` (one of `ALLREDUCE_ALGORITHMS`).

    `nodes` lists the member indices of each node (used by the hierarchical algorithms).
    """
    drive(group, allreduce_steps(algorithm, group, nodes, src, dst, op, segment_bytes=segment_bytes))


def allreduce_steps(
    algorithm: str,
    group: Group,
    nodes: Sequence[Sequence[int]],
    src: np.ndarray,
    dst: np.ndarray,
    op: ReduceOp,
    *,
    segment_bytes: int,
) -> Steps:
    """`run_allreduce` as a step machine (`schedule.Steps`), for drivers that do not block (the
    simulator runs every rank's machine on one thread); checks `algorithm` when called."""
    if algorithm == "reference":
        return reference_allreduce_steps(group, src, dst, op)
    if algorithm == "hierarchical" or algorithm == "hierarchical_tree":
        inner = "tree" if algorithm == "hierarchical_tree" else "ring"
        return hierarchical_allreduce_steps(group, nodes, src, dst, op, inner=inner, segment_bytes=segment_bytes)
    if algorithm == "ring":
        return ring_allreduce_steps(group, src, dst, op, segment_bytes=segment_bytes)
    if algorithm == "tree":
        return tree_allreduce_steps(group, src, dst, op, segment_bytes=segment_bytes)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; expected one of {ALLREDUCE_ALGORITHMS}")
