"""`Communicator.alltoall` on the threads backend, and the topology accessors (Horovod's cross rank
and size, and the module functions reading the last `init()`)."""

from __future__ import annotations

import numpy as np
import pytest

import collectives
from collectives import MismatchError, Topology, run_threads


def _sent_counts(rank: int, size: int) -> np.ndarray:
    """Uneven counts, different on every rank, zeros included."""
    return np.array([(rank * 3 + dst * 2) % 4 for dst in range(size)], dtype=np.int64)


def _rows(rank: int, dst: int, count: int) -> np.ndarray:
    """The rows `rank` sends to `dst`: values that name sender, receiver and row."""
    return np.array([[rank * 1000 + dst * 10 + i, -i] for i in range(count)], dtype=np.float64).reshape(count, 2)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 7])
def test_alltoall_delivers_uneven_blocks_in_rank_order(world_size: int) -> None:
    def body(comm: collectives.Communicator) -> tuple[np.ndarray, np.ndarray]:
        counts = _sent_counts(comm.rank, comm.size)
        x = np.concatenate([_rows(comm.rank, dst, int(c)) for dst, c in enumerate(counts)])
        return comm.alltoall(x, counts.tolist())

    for rank, (received, counts) in enumerate(run_threads(body, world_size, timeout=20)):
        expected_counts = [int(_sent_counts(src, world_size)[rank]) for src in range(world_size)]
        assert counts.tolist() == expected_counts
        expected = np.concatenate([_rows(src, rank, c) for src, c in enumerate(expected_counts)])
        np.testing.assert_array_equal(received, expected)


@pytest.mark.parametrize("world_size", [2, 4])
def test_alltoall_without_counts_splits_evenly_and_keeps_row_shape_and_dtype(world_size: int) -> None:
    def body(comm: collectives.Communicator) -> tuple[np.ndarray, np.ndarray]:
        x = np.arange(world_size * 2 * 3, dtype=np.int32).reshape(world_size * 2, 3) + 100 * comm.rank
        return comm.alltoall(x)

    for rank, (received, counts) in enumerate(run_threads(body, world_size, timeout=20)):
        assert received.dtype == np.int32 and received.shape == (world_size * 2, 3)
        assert counts.tolist() == [2] * world_size
        for src in range(world_size):
            block = np.arange(rank * 6, rank * 6 + 6, dtype=np.int32).reshape(2, 3) + 100 * src
            np.testing.assert_array_equal(received[src * 2 : src * 2 + 2], block)


def test_alltoall_refuses_bad_counts_naming_the_rank() -> None:
    def body(comm: collectives.Communicator) -> None:
        with pytest.raises(ValueError, match=f"rank {comm.rank}: .*5 rows do not divide among 2 ranks"):
            comm.alltoall(np.zeros(5))
        with pytest.raises(ValueError, match="sum to the 5 rows"):
            comm.alltoall(np.zeros(5), [1, 1])
        with pytest.raises(ValueError, match="non-negative"):
            comm.alltoall(np.zeros(5), [6, -1])
        with pytest.raises(ValueError, match=r"got \[18446744073709551615, 2\]"):  # not -1 after a cast
            comm.alltoall(np.zeros(1), np.array([2**64 - 1, 2], dtype=np.uint64))
        with pytest.raises(ValueError, match="2 integers"):
            comm.alltoall(np.zeros(5), [5])
        with pytest.raises(ValueError, match="at least one dimension"):
            comm.alltoall(np.float64(1.0))

    run_threads(body, 2, timeout=20)


def test_alltoall_with_different_row_shapes_is_a_mismatch_on_every_rank() -> None:
    def body(comm: collectives.Communicator) -> str:
        with pytest.raises(MismatchError) as raised:
            comm.alltoall(np.zeros((2, 3 + comm.rank)))
        return str(raised.value)

    for message in run_threads(body, 2, timeout=20):
        assert "row_shape=(3,)" in message or "row_shape=(4,)" in message


@pytest.mark.parametrize(
    ("hosts", "cross_ranks", "cross_sizes"),
    [
        (("a", "a", "b", "b"), [0, 0, 1, 1], [2, 2, 2, 2]),
        (("a", "b", "a", "b", "c", "c"), [0, 1, 0, 1, 2, 2], [3, 3, 3, 3, 3, 3]),
        (("a", "a", "a", "b"), [0, 0, 0, 1], [2, 1, 1, 2]),  # only two ranks have local rank 0
        (("a",) * 3, [0, 0, 0], [1, 1, 1]),
    ],
)
def test_cross_rank_and_size_follow_horovod(hosts, cross_ranks, cross_sizes) -> None:
    topology = Topology(hosts)
    assert [topology.cross_rank(r) for r in range(len(hosts))] == cross_ranks
    assert [topology.cross_size(r) for r in range(len(hosts))] == cross_sizes


def test_communicator_and_module_accessors_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(comm: collectives.Communicator) -> tuple[int, ...]:
        return comm.rank, comm.local_rank, comm.local_size, comm.cross_rank, comm.cross_size

    assert run_threads(body, 4, ranks_per_node=2, timeout=20) == [
        (0, 0, 2, 0, 2),
        (1, 1, 2, 0, 2),
        (2, 0, 2, 1, 2),
        (3, 1, 2, 1, 2),
    ]
    monkeypatch.delenv("COLLECTIVES_BACKEND", raising=False)
    comm = collectives.init("threads")
    try:
        accessors = (collectives.rank, collectives.size, collectives.local_rank, collectives.local_size)
        assert [f() for f in accessors] == [0, 1, 0, 1]
        assert (collectives.cross_rank(), collectives.cross_size()) == (0, 1)
    finally:
        comm.close()
