"""The simulated backend: exact virtual times for simple patterns, contention, determinism,
correct results from the real algorithms, failures that are reported instead of hanging."""

from __future__ import annotations

import math

import numpy as np
import pytest

from backends.errors import CollectiveTimeoutError, MismatchError
from backends.simulated import Cluster, Link, SimulatedTransport, simulate
from collectives.allreduce import ALLREDUCE_ALGORITHMS
from collectives.simulation import simulate_allreduce

H = b"header"
INTRA = Link(alpha=1e-6, bandwidth=1e9)
INTER = Link(alpha=10e-6, bandwidth=1e8)


def cluster(nodes: int, per_node: int, **kwargs) -> Cluster:
    return Cluster(nodes, per_node, INTRA, INTER, **kwargs)


def test_one_message_costs_alpha_plus_size_over_bandwidth() -> None:
    """A send and its receive both complete alpha + n/bw after the send is posted, on each link class."""

    def body(t: SimulatedTransport) -> float:
        buf = t.empty(1000, np.uint8)
        if t.rank == 0:
            t.isend(buf, 1, 0, H).wait(None)
            t.isend(buf, 2, 0, H).wait(None)
        elif t.rank < 3:
            t.irecv(buf, 0, 0, H).wait(None)
        return t.clock()

    run = simulate(body, cluster(2, 2), timing_only=True)
    intra = INTRA.alpha + 1000 / INTRA.bandwidth
    inter = INTER.alpha + 1000 / INTER.bandwidth
    assert run.finish_times == pytest.approx((intra + inter, intra, intra + inter, 0.0))


def test_flows_share_the_nic() -> None:
    """k ranks of a node sending across at once through a NIC of bandwidth B take k n/B together;
    without a NIC limit each takes only alpha + n/bw."""
    n = 1_000_000

    def body(t: SimulatedTransport) -> float:
        buf = t.empty(n, np.uint8)
        if t.rank < 4:
            t.isend(buf, t.rank + 4, 0, H).wait(None)
        else:
            t.irecv(buf, t.rank - 4, 0, H).wait(None)
        return t.clock()

    shared = simulate(body, cluster(2, 4, nic_bandwidth=INTER.bandwidth), timing_only=True)
    assert shared.time == pytest.approx(INTER.alpha + 4 * n / INTER.bandwidth)
    free = simulate(body, cluster(2, 4), timing_only=True)
    assert free.time == pytest.approx(INTER.alpha + n / INTER.bandwidth)


def test_reductions_are_charged_gamma_per_byte() -> None:
    """A ufunc on a simulated buffer advances its rank's clock by gamma per output byte."""

    def body(t: SimulatedTransport) -> float:
        a = t.empty(250, np.float32)
        np.add(a, a, out=a)
        return t.clock()

    run = simulate(body, cluster(1, 1, gamma=1e-9))
    assert run.time == pytest.approx(1000 * 1e-9)


@pytest.mark.parametrize("algorithm", ALLREDUCE_ALGORITHMS)
def test_real_algorithms_reduce_correctly_and_deterministically(algorithm: str) -> None:
    """Every algorithm gives the exact sum on an uneven-sized cluster, and two runs take the same
    virtual time to the last bit."""
    shape = cluster(2, 3, nic_bandwidth=1.5e8, gamma=1e-10)
    first = simulate_allreduce(shape, algorithm, 4004, timing_only=False, segment_bytes=512)
    for result in first.results:
        np.testing.assert_array_equal(result, np.full(1001, 21, np.float32))
    again = simulate_allreduce(shape, algorithm, 4004, timing_only=False, segment_bytes=512)
    assert again.finish_times == first.finish_times and first.time > 0


def test_timing_only_matches_real_data_and_allocates_nothing() -> None:
    """Size-only buffers give the same virtual time as real ones; a 256 MiB run on 16 ranks is fine."""
    shape = cluster(2, 2, gamma=1e-10)
    real = simulate_allreduce(shape, "ring", 1 << 16, timing_only=False)
    virtual = simulate_allreduce(shape, "ring", 1 << 16, timing_only=True)
    assert real.finish_times == virtual.finish_times
    big = simulate_allreduce(cluster(4, 4, gamma=1e-10), "hierarchical", 256 << 20)
    assert big.time > (256 << 20) / INTRA.bandwidth


def test_256_ranks() -> None:
    """The simulator runs the real tree all-reduce on 256 ranks."""
    run = simulate_allreduce(cluster(32, 8), "tree", 4096)
    assert run.messages > 0 and math.isfinite(run.time)


def test_deadlock_is_reported_not_hung() -> None:
    """A receive nobody sends fails with a timeout error naming the simulated deadlock."""

    def body(t: SimulatedTransport) -> None:
        if t.rank == 0:
            t.irecv(t.empty(1, np.uint8), 1, 0, H).wait(None)

    with pytest.raises(CollectiveTimeoutError, match="simulated deadlock"):
        simulate(body, cluster(1, 2))


def test_header_mismatch() -> None:
    """Different headers fail both sides with MismatchError, as on real backends."""

    def body(t: SimulatedTransport) -> None:
        buf = t.empty(1, np.uint8)
        if t.rank == 0:
            t.isend(buf, 1, 0, b"allreduce").wait(None)
        else:
            t.irecv(buf, 0, 0, b"barrier").wait(None)

    with pytest.raises(MismatchError, match="barrier"):
        simulate(body, cluster(1, 2))
