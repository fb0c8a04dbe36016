"""Property tests: random worlds, layouts, shapes, dtypes, ops and algorithms against numpy."""

from __future__ import annotations

from typing import Any

import numpy as np
from conftest import (
    ALL_ALGORITHMS,
    DTYPES,
    NATIVE_DTYPES,
    assert_identical,
    assert_reduced,
    layouts,
    make_input,
    valid_ops,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
"""Shapes of up to 3 dimensions, zero-size dimensions and 0-d included."""


@st.composite
def allreduce_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A world (size 1..6 and one of its node layouts) and one all-reduce call for it."""
    world_size = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(DTYPES))
    return {
        "world_size": world_size,
        "ranks_per_node": draw(st.sampled_from(layouts(world_size)))[1],
        "shape": draw(shapes),
        "dtype": dtype,
        "op": draw(st.sampled_from(valid_ops(dtype))),
        "algorithm": draw(
            st.sampled_from([a for a in ALL_ALGORITHMS if a != collectives.NATIVE or dtype in NATIVE_DTYPES])
        ),
        "segment_bytes": draw(st.sampled_from([1, 8, 64, 4096])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@given(case=allreduce_cases())
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
def test_allreduce_matches_numpy(case: dict[str, Any]) -> None:
    """Any all-reduce equals the float64 (integers: exact) reference within the dtype's tolerance,
    has the input's shape and dtype, and is bit-identical on every rank."""
    world_size, shape, dtype, op = case["world_size"], case["shape"], case["dtype"], case["op"]

    def body(comm: collectives.Communicator) -> np.ndarray:
        x = make_input(comm.rank, shape, dtype, op, seed=case["seed"])
        return comm.allreduce(x, op=op, algorithm=case["algorithm"])

    results = collectives.run_threads(
        body, world_size, ranks_per_node=case["ranks_per_node"], segment_bytes=case["segment_bytes"], timeout=30
    )
    inputs = [make_input(rank, shape, dtype, op, seed=case["seed"]) for rank in range(world_size)]
    assert_reduced(results[0], inputs, op)
    assert_identical(results)


@given(
    world_size=st.integers(1, 6),
    rows=st.integers(0, 20),
    tail=st.lists(st.integers(0, 4), max_size=2).map(tuple),
    root=st.integers(0, 5),
    segment_bytes=st.sampled_from([1, 16, 4096]),
)
@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
def test_scatter_gather_broadcast_compose(
    world_size: int, rows: int, tail: tuple[int, ...], root: int, segment_bytes: int
) -> None:
    """allgather(reduce_scatter(x)) is the sum over ranks of x (exactly, for int64), and a broadcast
    from any root delivers the root's array to everyone."""
    root %= world_size
    shape = (rows, *tail)

    def body(comm: collectives.Communicator) -> tuple[np.ndarray, np.ndarray]:
        x = make_input(comm.rank, shape, np.int64)
        block = comm.reduce_scatter(x)
        return _gather_uneven(comm, block, rows), comm.broadcast(x, root=root)

    per_rank = collectives.run_threads(body, world_size, segment_bytes=segment_bytes, timeout=30)
    inputs = [make_input(rank, shape, np.int64) for rank in range(world_size)]
    for gathered, broadcast in per_rank:
        assert_reduced(gathered, inputs, "sum")
        np.testing.assert_array_equal(broadcast, inputs[root])


def _gather_uneven(comm: collectives.Communicator, block: np.ndarray, rows: int) -> np.ndarray:
    """allgather needs equal shapes: pad every block to the largest block's rows, gather, unpad."""
    largest = -(-rows // comm.size)
    padded = np.zeros((largest, *block.shape[1:]), block.dtype)
    padded[: block.shape[0]] = block
    gathered = comm.allgather(padded)
    base, extra = divmod(rows, comm.size)
    pieces = [gathered[r * largest : r * largest + base + (1 if r < extra else 0)] for r in range(comm.size)]
    return np.concatenate(pieces)
