"""Tree shapes (binary and double binary trees), chunk layout and topology: pure functions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives import Topology
from collectives.algorithms.tree import binary_tree, double_binary_tree
from collectives.core.layout import even_bounds, segment_items, segments

TREE_SIZES = list(range(1, 34)) + [63, 64, 65, 100, 128, 255]

Tree = tuple[tuple, tuple]


def check_tree(tree: Tree, size: int) -> int:
    """Assert `tree` = (parents, children) is a valid tree over ranks 0..size-1 with at most two
    children per rank and depth <= ceil(log2 size); return its root."""
    parents, children = tree
    assert len(parents) == len(children) == size
    roots = [rank for rank, parent in enumerate(parents) if parent is None]
    assert len(roots) == 1, f"roots {roots}"
    for rank, kids in enumerate(children):
        assert len(kids) <= 2, f"rank {rank} has children {kids}"
        assert list(kids) == sorted(set(kids)), f"rank {rank} children not sorted/unique: {kids}"
        for kid in kids:
            assert 0 <= kid < size and parents[kid] == rank, f"child {kid} of {rank} has parent {parents[kid]}"
    for rank, parent in enumerate(parents):
        if parent is not None:
            assert 0 <= parent < size and rank in children[parent]
    # every rank reachable from the root, each exactly once (no cycles)
    seen, frontier = {roots[0]}, [roots[0]]
    depth = 0
    while frontier:
        next_frontier = [kid for rank in frontier for kid in children[rank]]
        assert not seen.intersection(next_frontier)
        seen.update(next_frontier)
        if next_frontier:
            depth += 1
        frontier = next_frontier
    assert seen == set(range(size)), f"unreachable: {set(range(size)) - seen}"
    assert depth <= (math.ceil(math.log2(size)) if size > 1 else 0), f"depth {depth} for {size} ranks"
    return roots[0]


@pytest.mark.parametrize("size", TREE_SIZES)
def test_binary_tree_is_valid_and_rooted_at_zero(size: int) -> None:
    """binary_tree(n) is a tree over all n ranks rooted at rank 0, <= 2 children, logarithmic depth."""
    assert check_tree(binary_tree(size), size) == 0


@pytest.mark.parametrize("size", TREE_SIZES)
def test_double_binary_tree_both_valid(size: int) -> None:
    """Both trees of double_binary_tree(n) are valid trees over all ranks; the first is binary_tree(n)."""
    first, second = double_binary_tree(size)
    assert first == binary_tree(size)
    assert check_tree(first, size) == 0
    check_tree(second, size)


@pytest.mark.parametrize("size", [s for s in TREE_SIZES if s % 2 == 0])
def test_double_binary_tree_complementary_for_even_sizes(size: int) -> None:
    """For even n every inner node of tree A is a leaf of tree B and vice versa, so each rank
    forwards data in only one tree (the point of the double tree)."""
    (_, children_a), (_, children_b) = double_binary_tree(size)
    inner_a = {rank for rank in range(size) if children_a[rank]}
    inner_b = {rank for rank in range(size) if children_b[rank]}
    assert not inner_a & inner_b, f"inner in both trees: {sorted(inner_a & inner_b)}"
    assert inner_a and inner_b


@pytest.mark.parametrize("size", [s for s in TREE_SIZES if s % 2 == 1 and s > 1])
def test_double_binary_tree_odd_sizes_share_only_rank_zero(size: int) -> None:
    """For odd n the shifted second tree overlaps the first in inner nodes only at rank 0."""
    (_, children_a), (_, children_b) = double_binary_tree(size)
    both = {rank for rank in range(size) if children_a[rank] and children_b[rank]}
    assert both <= {0}, sorted(both)


def test_binary_tree_known_shape() -> None:
    """The 8-rank tree is NCCL's: 0-4, 4-{2,6}, 2-{1,3}, 6-{5,7}; its mirror is rooted at 7."""
    parents, children = binary_tree(8)
    assert parents == (None, 2, 4, 2, 0, 6, 4, 6)
    assert children == ((4,), (), (1, 3), (), (2, 6), (), (5, 7), ())
    _, (second_parents, _) = double_binary_tree(8)
    assert second_parents == tuple(None if p is None else 7 - p for p in reversed(parents))


# -- layout ----------------------------------------------------------------------------------------


def test_even_bounds_docstring_example() -> None:
    """even_bounds(10, 4) == [0, 3, 6, 8, 10] as documented."""
    assert even_bounds(10, 4) == [0, 3, 6, 8, 10]


@given(count=st.integers(0, 10_000), parts=st.integers(1, 64))
@settings(max_examples=200, deadline=None, database=None)
def test_even_bounds_properties(count: int, parts: int) -> None:
    """even_bounds covers [0, count] in `parts` contiguous chunks whose sizes differ by at most one,
    the first count % parts chunks being the larger ones."""
    bounds = even_bounds(count, parts)
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == count
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    extra = count % parts
    assert sizes == [count // parts + 1] * extra + [count // parts] * (parts - extra)


@given(lo=st.integers(0, 1000), length=st.integers(0, 1000), per=st.integers(1, 300))
@settings(max_examples=200, deadline=None, database=None)
def test_segments_tile_the_range(lo: int, length: int, per: int) -> None:
    """segments(lo, hi, n) cuts [lo, hi) into consecutive non-empty pieces of at most n items."""
    hi = lo + length
    pieces = segments(lo, hi, per)
    assert all(0 < b - a <= per for a, b in pieces)
    assert [a for a, _ in pieces] == list(range(lo, hi, per))
    assert (pieces[-1][1] if pieces else lo) == hi
    assert all(pieces[i][1] == pieces[i + 1][0] for i in range(len(pieces) - 1))


@pytest.mark.parametrize(
    ("itemsize", "segment_bytes", "expected"),
    [(8, 1024, 128), (2, 1024, 512), (8, 7, 1), (4, 1, 1), (1, 1, 1), (0, 10, 10), (8, 1023, 127)],
)
def test_segment_items(itemsize: int, segment_bytes: int, expected: int) -> None:
    """Items per segment: whole items fitting the byte budget, at least one."""
    assert segment_items(itemsize, segment_bytes) == expected


# -- topology --------------------------------------------------------------------------------------


def test_topology_groups_ranks_by_host() -> None:
    """Nodes are ordered by lowest rank, even when a node's ranks are not contiguous."""
    topology = Topology(("b", "a", "b", "c", "a"))
    assert topology.nodes == ((0, 2), (1, 4), (3,))
    assert topology.size == 5 and topology.num_nodes == 3
    assert [topology.node_of(r) for r in range(5)] == [0, 1, 0, 2, 1]
    assert [topology.local_rank(r) for r in range(5)] == [0, 0, 1, 0, 1]
    assert [topology.local_size(r) for r in range(5)] == [2, 2, 2, 1, 2]


@pytest.mark.parametrize(
    ("hosts", "hierarchical"),
    [(("a",), False), (("a", "a"), False), (("a", "b"), False), (("a", "a", "b"), True), (("a", "b", "a", "b"), True)],
)
def test_topology_is_hierarchical(hosts: tuple[str, ...], hierarchical: bool) -> None:
    """Hierarchical means several nodes and at least one node with several ranks."""
    assert Topology(hosts).is_hierarchical is hierarchical
