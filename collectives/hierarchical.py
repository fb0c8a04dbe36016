"""Hierarchical all-reduce: reduce inside each node, all-reduce across nodes, share inside each node.

Links inside a node (shared memory, NVLink) are much faster than links between nodes, so the
inter-node step should move as little as possible and use every rank's link at once::

    node 0: r0 r1      1. ring reduce-scatter inside each node: local rank j owns shard j
    node 1: r2 r3      2. all-reduce shard j among the ranks with local rank j (r0+r2, r1+r3),
                          with a ring or a tree (`inner`), all shards in parallel
                       3. ring all-gather inside each node

Every byte crosses the inter-node network 2(N-1)/N times (N nodes) in parallel over the L ranks of
a node, instead of the flat ring's 2(p-1)/p n through one link per rank pair.

Uneven nodes: the buffer is cut into M shards, M = the smallest node's rank count; on larger nodes
local ranks >= M own no shard and sit out step 2. One node is a plain ring all-reduce; one rank
per node is a plain `inner` all-reduce across nodes.

Cost with N nodes of L ranks, intra-node (alpha_l, beta_l), inter-node (alpha_g, beta_g)::

    2(L-1) alpha_l + 2(L-1)/L n beta_l + (L-1)/L n gamma           (steps 1 and 3)
    + inner all-reduce of n/L bytes over N ranks on (alpha_g, beta_g)  (step 2)
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .group import Group
from .layout import DEFAULT_SEGMENT_BYTES, even_bounds
from .ops import ReduceOp, finalize
from .ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from .tree import tree_allreduce

INNER_ALGORITHMS = {"ring": ring_allreduce, "tree": tree_allreduce}

_INTRA_SUBTAG = 8
_INTER_SUBTAG = 16


def hierarchical_allreduce(
    group: Group,
    nodes: Sequence[Sequence[int]],
    src: np.ndarray,
    dst: np.ndarray,
    op: ReduceOp,
    *,
    inner: str = "ring",
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> None:
    """dst = op over all members of src; `nodes` lists the member indices of each node.

    Args:
        inner: the all-reduce used between nodes, "ring" or "tree".
    """
    if inner not in INNER_ALGORITHMS:
        raise ValueError(f"inner algorithm must be one of {sorted(INNER_ALGORITHMS)}, got {inner!r}")
    me = group.rank
    node = next(ranks for ranks in nodes if me in ranks)
    local_rank = list(node).index(me)
    shards = min(len(ranks) for ranks in nodes)
    shard_bounds = even_bounds(src.size, shards)
    # Local ranks beyond the smallest node's size own empty chunks.
    chunk_bounds = shard_bounds + [src.size] * (len(node) - shards)

    intra = group.subgroup(node, _INTRA_SUBTAG)
    ring_reduce_scatter(intra, src, dst, op, chunk_bounds, segment_bytes=segment_bytes)
    if local_rank < shards:
        shard = dst[chunk_bounds[local_rank] : chunk_bounds[local_rank + 1]]
        inter = group.subgroup([ranks[local_rank] for ranks in nodes], _INTER_SUBTAG)
        sum_only = ReduceOp.SUM if op is ReduceOp.MEAN else op
        INNER_ALGORITHMS[inner](inter, shard, shard, sum_only, segment_bytes=segment_bytes)
        finalize(op, shard, group.size)
    ring_allgather(intra, dst, chunk_bounds, segment_bytes=segment_bytes)
