"""`run_allreduce`: run a named all-reduce algorithm on a group.

The one place that maps algorithm names to code, shared by the `Communicator` and by whatever runs
algorithms on a bare `Group` (the simulator harness, the tuning pass).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .group import Group
from .hierarchical import hierarchical_allreduce
from .ops import ReduceOp
from .reference import reference_allreduce
from .ring import ring_allreduce
from .tree import tree_allreduce

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
    if algorithm == "reference":
        reference_allreduce(group, src, dst, op)
    elif algorithm == "hierarchical" or algorithm == "hierarchical_tree":
        inner = "tree" if algorithm == "hierarchical_tree" else "ring"
        hierarchical_allreduce(group, nodes, src, dst, op, inner=inner, segment_bytes=segment_bytes)
    elif algorithm == "ring":
        ring_allreduce(group, src, dst, op, segment_bytes=segment_bytes)
    elif algorithm == "tree":
        tree_allreduce(group, src, dst, op, segment_bytes=segment_bytes)
    else:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; expected one of {ALLREDUCE_ALGORITHMS}")
