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
    tree          each tree carries n/2 in S = ceil(n/2s) segments of m bytes; per tree, up (reduce)
                  and down (broadcast) run at once, and the two trees independently:
                  fill + (S-1) period, timed on the schedule itself for S <= 3
                  fill = the slowest root-to-leaf-and-back path, sum of t(m) (+ the reductions);
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

import heapq
import math
from dataclasses import replace
from typing import Callable, Sequence

from .hierarchical import INTER_WINDOW, pipeline_blocks
from .layout import DEFAULT_BLOCK_BYTES
from .topology import LinkCost, LinkCosts, Topology
from .tree import double_binary_tree

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
    return LinkCost(max(inter.alpha, intra.alpha), max(inter.beta, intra.beta), max(inter.shared_beta, intra.shared_beta))


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
        return _ring_reduce_scatter(p, chunk, link, gamma, segment_bytes) + _ring_allgather(p, chunk, link, segment_bytes)

    return full * one_block(block) + (one_block(rest) if rest else 0.0)


def _tree_allreduce(
    nbytes: float, members: Sequence[int], node: Sequence[int], costs: LinkCosts, segment_bytes: int, concurrent: int = 1
) -> float:
    """Double binary tree over `members` (global ranks); `concurrent` such trees share the NICs.

    The two trees, and each tree's reduction and broadcast, run side by side at their own pace,
    sharing each rank's send port; the segments' hops overlap in ways no closed form follows
    well, so the schedule itself is timed (`_tree_schedule`) for one to three segments per tree,
    and longer streams are extrapolated from the last period, which is constant from then on.
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
    """Time `tree.tree_allreduce`'s schedule with `count` segments of `piece` bytes per tree.

    Each rank runs four programs side by side, as the code runs each tree's reduction and its
    broadcast as separate step machines: per tree, up (receive and reduce each child's segment,
    send the sum to the parent, or at the root hand it to down) and down (receive each final
    segment from the parent, forward it to the children). A rank's sends leave one after another
    from its send port; a message arrives alpha + m beta after it leaves. The operation ready
    first runs first, so the port serves the programs' sends in the order they become ready.
    """
    p = len(trees[0][0])
    programs: list[tuple[int, list[tuple]]] = []
    for rank in range(p):
        for tree, (parents, children) in enumerate(trees):
            up: list[tuple] = []
            down: list[tuple] = []
            for k in range(count):
                for child in children[rank]:
                    up.append(("recv", ("up", tree, k, child)))
                    up.append(("compute", piece * gamma))
                if parents[rank] is None:
                    up.append(("final", ("down", tree, k, rank)))
                else:
                    up.append(("send", ("up", tree, k, rank), link(rank, parents[rank])))
                down.append(("recv", ("down", tree, k, rank)))
                for child in children[rank]:
                    down.append(("send", ("down", tree, k, child), link(rank, child)))
            programs += [(rank, up), (rank, down)]
    arrival: dict[tuple, float] = {}
    waiting: dict[tuple, list[int]] = {}
    clock = [0.0] * len(programs)
    position = [0] * len(programs)
    port = [0.0] * p
    ready = [(0.0, index) for index in range(len(programs))]
    while ready:
        _, index = heapq.heappop(ready)
        rank, ops = programs[index]
        if position[index] == len(ops):
            continue
        op = ops[position[index]]
        if op[0] == "recv":
            if op[1] not in arrival:
                waiting.setdefault(op[1], []).append(index)
                continue
            clock[index] = max(clock[index], arrival[op[1]])
        elif op[0] == "compute":
            clock[index] += op[1]
        else:
            if op[0] == "send":
                port[rank] = max(clock[index], port[rank]) + op[2].time(piece)
            arrival[op[1]] = port[rank] if op[0] == "send" else clock[index]
            for other in waiting.pop(op[1], ()):
                heapq.heappush(ready, (max(clock[other], arrival[op[1]]), other))
        position[index] += 1
        heapq.heappush(ready, (clock[index], index))
    return max(max(clock), max(port))


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
        intra = _ring_reduce_scatter(largest, shard, costs.intra, costs.gamma, segment_bytes) + _ring_allgather(
            largest, shard, costs.intra, segment_bytes
        ) if largest > 1 else 0.0
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
