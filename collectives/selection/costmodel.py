"""Alpha-beta-gamma cost model of every all-reduce algorithm, in one table (`ALGORITHM_COSTS`).

Notation: n bytes per rank, p ranks on N nodes of L ranks (M = the smallest node), s the segment
size, t(m) = alpha + m beta the time of one m-byte message on a link, gamma the reduction time per
byte. A link is `intra` inside a node; between nodes it is `inter`, and k flows leaving one node at
once share its NIC: t(m) = max(alpha + m beta_inter, m k nic_beta). Every message also pays alpha
on its sender, so a stream of S segments costs S t(m/S), not t(m) + (S-1) m/S beta.

    ring          per block of b = max(4 MiB, p s) bytes, chunk m = b/p in S = ceil(m/s) segments:
                  (p-1) (S t(m/S) + m/S gamma)  +  (p-1) S t(m/S)
                  reduce-scatter, then all-gather, paced by the ring's slowest link (inter, with
                  k = ring edges leaving a node, when the ring crosses nodes)
    tree          each tree carries n/2 in S = ceil(n/2s) segments of m bytes; up (reduce) then down:
                  fill_up + (S-1) period_up  +  fill_down + (S-1) period_down
                  fill = the slowest root-to-leaf path, sum of t(m) (+ the reductions going up);
                  period = the busiest resource per pair of segments: a rank's send port
                  (sum of t(m) over its sends), its receive port, a node's NIC, a rank's reductions
    hierarchical  B blocks (`hierarchical.pipeline_blocks`), shard h = n/(B M) per block:
                  intra(b) = (L-1) (S t_intra(h/S) + h/S gamma)       intra reduce-scatter
                           + (L-1) S t_intra(h/S)                     intra all-gather
                  inter(b) = ring over N nodes on h bytes, k = M      all shards at once
                  period = max(inter(b) / W, inter(b) with alpha_inter = 0), W blocks crossing at once
                  intra(b) + inter(b) + (B-1) max(intra(b), period)
                  the phases are pipelined over the blocks: the slower side sets the pace, the
                  first block fills the pipeline and the last drains it; the W blocks in flight
                  between nodes hide each other's latencies, not their bytes
    hierarchical_tree   the same with the tree between nodes
    reference     2 (p-1) t(n) + (p-1) n gamma, all through rank 0: the test oracle, never chosen

These follow what the code does, segments and blocks included (see each module's docstring for
the algorithm itself), and the simulated backend checks them: on its grid of clusters the choice
they make is within a few percent of the best algorithm (docs/selector.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from collectives.algorithms.hierarchical import INTER_WINDOW, pipeline_blocks
from collectives.algorithms.tree import double_binary_tree
from collectives.core.layout import DEFAULT_BLOCK_BYTES
from collectives.core.topology import LinkCost, LinkCosts, Topology

AUTO_CANDIDATES = ("ring", "tree", "hierarchical", "hierarchical_tree")
"""What `auto` chooses from: never `reference` (it gathers p copies on rank 0) or `native` (no model)."""


def candidates(topology: Topology) -> tuple[str, ...]:
    """The algorithms `auto` considers on `topology`; the hierarchical ones only where they differ
    from the flat ones (several nodes, at least one with several ranks)."""
    if topology.is_hierarchical:
        return AUTO_CANDIDATES
    return ("ring", "tree")


def predict(algorithm: str, nbytes: int, topology: Topology, costs: LinkCosts, segment_bytes: int) -> float:
    """Predicted seconds for one all-reduce of `nbytes` per rank with `algorithm`."""
    if topology.size == 1 or nbytes <= 0:
        return 0.0
    return ALGORITHM_COSTS[algorithm](nbytes, topology, costs, segment_bytes)


# -- building blocks --------------------------------------------------------------------------------


def _segments(nbytes: float, segment_bytes: int) -> tuple[int, float]:
    """(segments, bytes per segment) for a stream of `nbytes`."""
    count = max(1, math.ceil(nbytes / segment_bytes))
    return count, nbytes / count


def _ring_link(members: Sequence[int], node: Sequence[int], costs: LinkCosts, concurrent: int = 1) -> LinkCost:
    """The slowest link of a ring over `members` (global ranks, in ring order).

    `concurrent` rings run at once over the same nodes (the shards of the hierarchical algorithm).
    """
    leaving: dict[int, int] = {}
    for index, rank in enumerate(members):
        nxt = members[(index + 1) % len(members)]
        if node[rank] != node[nxt]:
            leaving[node[rank]] = leaving.get(node[rank], 0) + 1
    if not leaving:
        return costs.intra
    inter = costs.inter_flow(concurrent * max(leaving.values()))
    if len(leaving) == len(members):  # every edge leaves its node
        return inter
    intra = costs.intra
    return LinkCost(
        max(inter.alpha, intra.alpha), max(inter.beta, intra.beta), max(inter.shared_beta, intra.shared_beta)
    )


def _ring_reduce_scatter(p: int, chunk: float, link: LinkCost, gamma: float, segment_bytes: int) -> float:
    count, piece = _segments(chunk, segment_bytes)
    return (p - 1) * (count * link.time(piece) + piece * gamma)


def _ring_allgather(p: int, chunk: float, link: LinkCost, segment_bytes: int) -> float:
    count, piece = _segments(chunk, segment_bytes)
    return (p - 1) * count * link.time(piece)


def _ring_allreduce(nbytes: float, p: int, link: LinkCost, gamma: float, segment_bytes: int) -> float:
    if p == 1:
        return 0.0
    block = max(DEFAULT_BLOCK_BYTES, p * segment_bytes)
    full, rest = divmod(nbytes, block)

    def one_block(size: float) -> float:
        chunk = size / p
        return _ring_reduce_scatter(p, chunk, link, gamma, segment_bytes) + _ring_allgather(
            p, chunk, link, segment_bytes
        )

    return full * one_block(block) + (one_block(rest) if rest else 0.0)


def _tree_allreduce(
    nbytes: float,
    members: Sequence[int],
    node: Sequence[int],
    costs: LinkCosts,
    segment_bytes: int,
    concurrent: int = 1,
) -> float:
    """Double binary tree over `members` (global ranks); `concurrent` such trees share the NICs.

    Each rank handles the two trees' segments strictly in turn (A0 B0 A1 B1 ...), so a rank's
    progress in one tree waits for its progress in the other, and the pipeline's period is a cycle
    of hops that zigzags between the trees rather than one hop. No closed form follows that well,
    so the schedule itself is timed (`_tree_schedule`) for one to three segments per tree, and
    longer streams are extrapolated from the last period, which is constant from then on.
    """
    p = len(members)
    if p == 1:
        return 0.0
    count, piece = _segments(nbytes / 2, segment_bytes)
    trees = double_binary_tree(p)
    # A rank sends one message at a time, so a node's NIC carries at most one flow per rank of
    # the node that has a tree edge to another node.
    senders: dict[int, set[int]] = {}
    for parents, _ in trees:
        for child, parent in enumerate(parents):
            if parent is not None and node[members[child]] != node[members[parent]]:
                for a in (child, parent):
                    senders.setdefault(node[members[a]], set()).add(a)
    inter = costs.inter_flow(concurrent * max((len(s) for s in senders.values()), default=1))

    def link(a: int, b: int) -> LinkCost:
        return inter if node[members[a]] != node[members[b]] else costs.intra

    if count <= 3:
        return _tree_schedule(trees, link, piece, costs.gamma, count)
    two, three = (_tree_schedule(trees, link, piece, costs.gamma, k) for k in (2, 3))
    return three + (count - 3) * (three - two)


def _tree_schedule(trees: tuple, link: Callable[[int, int], LinkCost], piece: float, gamma: float, count: int) -> float:
    """Time `tree.tree_allreduce_steps`' schedule with `count` segments of `piece` bytes per tree.

    Every rank runs its program in order (receive and reduce each child's segment, send to the
    parent; after all sends are done, receive from the parent and forward to the children); a
    rank's sends leave one after another from its send port; a message arrives alpha + m beta
    after it leaves. Ranks are advanced in turn until each has run its whole program.
    """
    p = len(trees[0][0])
    order = [(tree, k) for k in range(count) for tree in (0, 1)]
    programs: list[list[tuple]] = []
    for rank in range(p):
        ops: list[tuple] = []
        for tree, k in order:
            parents, children = trees[tree]
            for child in children[rank]:
                ops.append(("recv", ("up", tree, k, child)))
                ops.append(("compute", piece * gamma))
            if parents[rank] is not None:
                ops.append(("send", ("up", tree, k, rank), link(rank, parents[rank])))
        ops.append(("drain",))
        for tree, k in order:
            parents, children = trees[tree]
            if parents[rank] is not None:
                ops.append(("recv", ("down", tree, k, rank)))
            for child in children[rank]:
                ops.append(("send", ("down", tree, k, child), link(rank, child)))
        ops.append(("drain",))
        programs.append(ops)
    arrival: dict[tuple, float] = {}
    clock = [0.0] * p
    port = [0.0] * p
    position = [0] * p
    unfinished = p
    while unfinished:
        for rank in range(p):
            ops = programs[rank]
            at = position[rank]
            while at < len(ops):
                op = ops[at]
                if op[0] == "recv":
                    if op[1] not in arrival:
                        break
                    clock[rank] = max(clock[rank], arrival[op[1]])
                elif op[0] == "send":
                    port[rank] = max(clock[rank], port[rank]) + op[2].time(piece)
                    arrival[op[1]] = port[rank]
                elif op[0] == "compute":
                    clock[rank] += op[1]
                else:
                    clock[rank] = max(clock[rank], port[rank])
                at += 1
            if at == len(ops) and position[rank] < len(ops):
                unfinished -= 1
            position[rank] = at
    return max(clock)


# -- the algorithms ---------------------------------------------------------------------------------


def _ring(nbytes: int, topology: Topology, costs: LinkCosts, segment_bytes: int) -> float:
    link = _ring_link(range(topology.size), topology.node_index, costs)
    return _ring_allreduce(nbytes, topology.size, link, costs.gamma, segment_bytes)


def _tree(nbytes: int, topology: Topology, costs: LinkCosts, segment_bytes: int) -> float:
    return _tree_allreduce(nbytes, range(topology.size), topology.node_index, costs, segment_bytes)


def _hierarchical(inner: str) -> Callable[[int, Topology, LinkCosts, int], float]:
    def cost(nbytes: int, topology: Topology, costs: LinkCosts, segment_bytes: int) -> float:
        nodes = topology.nodes
        shards = min(len(ranks) for ranks in nodes)
        largest = max(len(ranks) for ranks in nodes)
        blocks = pipeline_blocks(nbytes, len(nodes), largest, shards, segment_bytes)
        shard = nbytes / blocks / shards
        intra = (
            _ring_reduce_scatter(largest, shard, costs.intra, costs.gamma, segment_bytes)
            + _ring_allgather(largest, shard, costs.intra, segment_bytes)
            if largest > 1
            else 0.0
        )
        leaders = [ranks[0] for ranks in nodes]
        node = topology.node_index

        def across(costs: LinkCosts) -> float:
            if inner == "ring":
                link = _ring_link(leaders, node, costs, concurrent=shards)
                return _ring_allreduce(shard, len(nodes), link, costs.gamma, segment_bytes)
            return _tree_allreduce(shard, leaders, node, costs, segment_bytes, concurrent=shards)

        between = across(costs)
        window = min(INTER_WINDOW, blocks)
        bytes_only = across(replace(costs, inter=replace(costs.inter, alpha=0.0)))
        period = max(between / window, bytes_only)
        return intra + between + (blocks - 1) * max(intra, period)

    return cost


def _reference(nbytes: int, topology: Topology, costs: LinkCosts, segment_bytes: int) -> float:
    p = topology.size
    link = costs.inter if topology.num_nodes > 1 else costs.intra
    return 2 * (p - 1) * link.time(nbytes) + (p - 1) * nbytes * costs.gamma


ALGORITHM_COSTS: dict[str, Callable[[int, Topology, LinkCosts, int], float]] = {
    "ring": _ring,
    "tree": _tree,
    "hierarchical": _hierarchical("ring"),
    "hierarchical_tree": _hierarchical("tree"),
    "reference": _reference,
}
"""Predicted seconds of each algorithm: (nbytes, topology, costs, segment_bytes) -> seconds."""
