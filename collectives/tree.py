r"""Tree all-reduce over a double binary tree, and a pipelined tree broadcast.

A binary tree reduces towards a root and broadcasts back in about 2 log2(p) steps, far fewer than
the ring's 2(p-1), so it wins for small messages. A single tree wastes half the bandwidth (leaves
only send once, inner nodes do all the work), so, as in NCCL, two complementary trees each carry
half of the buffer: every rank that is an inner node in one tree is a leaf in the other (for even
p; for odd p the second tree is shifted and rank 0 is inner in both)::

    tree A (p=8)            tree B: mirror image (rank -> 7-rank)
    0 -- 4                  7 -- 3
        / \                     / \
       2   6                   5   1
      / \ / \                 / \ / \
     1  3 5  7               6  4 2  0

Tree A follows NCCL's bit rule: the parent of r is found by clearing r's lowest set bit and setting
the next one up (or just clearing it if that is past the end). Both halves are cut into segments
that flow up (reduce) and then down (broadcast) the trees as a pipeline. Each tree runs as its own
step machines (`schedule.concurrently`), its reduction and broadcast at once, so a slow link or a
late peer in one tree never holds up the other, and a segment starts down as soon as it is reduced.

Cost for n bytes on p ranks, with S segments (each tree carries n/2)::

    all-reduce: 2 (log2(p) + S) alpha + ~2 n beta + ~n gamma   (pipelined, both trees at once)
    broadcast:  (log2(p) + S) alpha + ~2 n beta                 (single binary tree)

Logarithmic latency; per-rank bandwidth is worse than the ring's by a constant, so large messages
go to the ring.
"""

from __future__ import annotations

import functools

import numpy as np

from .group import Group, Pending
from .layout import DEFAULT_SEGMENT_BYTES, segment_items, segments
from .ops import ReduceOp, combine, finalize
from .pipeline import PIPELINE_DEPTH, ReduceSegment, ReduceStream
from .schedule import Steps, concurrently, pipeline_steps, run_steps


@functools.lru_cache(maxsize=256)
def binary_tree(size: int) -> tuple[tuple[int | None, ...], tuple[tuple[int, ...], ...]]:
    """NCCL's binary tree rooted at 0: (parent of each rank, children of each rank)."""
    parents: list[int | None] = [None]
    for rank in range(1, size):
        low_bit = rank & -rank
        parent = (rank ^ low_bit) | (low_bit << 1)
        parents.append(parent if parent < size else rank ^ low_bit)
    children: list[list[int]] = [[] for _ in range(size)]
    for rank, parent in enumerate(parents):
        if parent is not None:
            children[parent].append(rank)
    return tuple(parents), tuple(tuple(sorted(c)) for c in children)


@functools.lru_cache(maxsize=256)
def double_binary_tree(size: int) -> tuple[tuple, tuple]:
    """Two complementary trees: NCCL's tree, and its mirror (even size) or shift (odd size)."""
    parents, children = binary_tree(size)
    if size % 2 == 0:
        relabel = [size - 1 - rank for rank in range(size)]
    else:
        relabel = [(rank + 1) % size for rank in range(size)]
    second_parents: list[int | None] = [None] * size
    second_children: list[tuple[int, ...]] = [()] * size
    for rank in range(size):
        parent = parents[rank]
        second_parents[relabel[rank]] = None if parent is None else relabel[parent]
        second_children[relabel[rank]] = tuple(sorted(relabel[c] for c in children[rank]))
    return (parents, children), (tuple(second_parents), tuple(second_children))


def tree_allreduce(
    group: Group,
    src: np.ndarray,
    dst: np.ndarray,
    op: ReduceOp,
    *,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> None:
    """dst = op over all members of src, over a double binary tree; `src` may be `dst`."""
    run_steps(group, tree_allreduce_steps(group, src, dst, op, segment_bytes=segment_bytes))


def tree_allreduce_steps(
    group: Group,
    src: np.ndarray,
    dst: np.ndarray,
    op: ReduceOp,
    *,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> Steps:
    """`tree_allreduce` as a step machine (`schedule`), for the hierarchical all-reduce."""
    p, r = group.size, group.rank
    if p == 1:
        if src is not dst:
            dst[...] = src
        return
    trees = double_binary_tree(p)
    half = src.size // 2
    per_segment = segment_items(src.itemsize, segment_bytes)
    halves = [(0, half), (half, src.size)]

    def one_tree(tree: int) -> Steps:
        """Tree `tree`'s half of the buffer: up (reduce), then down (broadcast), per segment."""
        parent, children = trees[tree][0][r], trees[tree][1][r]
        pieces = segments(*halves[tree], per_segment)
        up_subtag, down_subtag = 2 * tree, 2 * tree + 1

        # The second child's segment is added to the first's sum, so reductions run in order
        # (fuse=False) and every rank's result is the root's, bit for bit.
        def reducer(first: bool) -> ReduceSegment:
            def reduce_segment(lo: int, hi: int, received: np.ndarray) -> None:
                combine(op, src[lo:hi] if first else dst[lo:hi], received, out=dst[lo:hi])

            return reduce_segment

        streams = [
            ReduceStream(group, child, up_subtag, pieces, dst, reducer(index == 0), fuse=False)
            for index, child in enumerate(children)
        ]
        sent_up: dict[int, Pending] = {}
        received: dict[int, Pending] = {}

        def up(segment: int) -> Steps:
            """Combine the children's partial results into dst and pass them on to the parent."""
            lo, hi = pieces[segment]
            for stream in streams:
                yield from stream.next_segment()
            if parent is None:  # a root always has children when p > 1, so dst holds the result
                finalize(op, dst[lo:hi], p)
            else:
                sent_up[segment] = group.isend(dst[lo:hi] if children else src[lo:hi], parent, up_subtag)

        def post(segment: int) -> Steps:
            """Post the receive of the final segment, in segment order (they match in posting order),
            once the partial result has left dst: the final one lands there."""
            if parent is not None:
                yield sent_up.pop(segment)
                lo, hi = pieces[segment]
                received[segment] = group.irecv(dst[lo:hi], parent, down_subtag)

        def down(segment: int) -> Steps:
            """Receive the final segment from the parent and forward it to the children."""
            if parent is not None:
                yield received.pop(segment)
            lo, hi = pieces[segment]
            yield from [group.isend(dst[lo:hi], child, down_subtag) for child in children]

        return pipeline_steps([up, post, down], len(pieces), (1, 1, PIPELINE_DEPTH))

    yield from concurrently([one_tree(0), one_tree(1)])


def tree_broadcast(
    group: Group,
    buf: np.ndarray,
    root: int,
    *,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> None:
    """Copy `buf` of member `root` into `buf` of every member, pipelined down a binary tree."""
    p = group.size
    if p == 1:
        return
    parents, children = binary_tree(p)
    virtual = (group.rank - root) % p  # relabel so that `root` is the tree's root

    def real(rank: int) -> int:
        return (rank + root) % p

    pieces = segments(0, buf.size, segment_items(buf.itemsize, segment_bytes))
    parent = parents[virtual]
    receives = [] if parent is None else [group.irecv(buf[lo:hi], real(parent)) for lo, hi in pieces]
    sends: list[Pending] = []
    for index, (lo, hi) in enumerate(pieces):
        if receives:
            group.wait(receives[index])
        for child in children[virtual]:
            sends.append(group.isend(buf[lo:hi], real(child)))
    group.waitall(sends)
