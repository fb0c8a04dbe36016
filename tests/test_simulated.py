"""The simulated backend: exact virtual times for simple patterns, contention, determinism,
correct results from the real algorithms, the same times from the one-thread driver and the
blocking one, failures that are reported instead of hanging."""

from __future__ import annotations

import math

import numpy as np
import pytest

from collectives import allreduce_algorithms
from collectives.algorithms.barrier import dissemination_barrier_steps
from collectives.algorithms.tree import tree_broadcast_steps
from collectives.backends.errors import CollectiveTimeoutError, MismatchError
from collectives.backends.simulated import Cluster, Link, RankSteps, SimulatedTransport, simulate, simulate_steps
from collectives.core.group import Group
from collectives.core.schedule import Steps, drive, wait_all
from collectives.core.tags import collective_tags
from collectives.selection.simulation import rank_steps, simulate_allreduce

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


@pytest.mark.parametrize("algorithm", allreduce_algorithms())
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


def test_1024_ranks_on_one_thread() -> None:
    """The one-thread driver runs the real tree all-reduce on 1024 ranks, each sending its share."""
    run = simulate_allreduce(cluster(128, 8), "tree", 1 << 16)
    assert len(run.finish_times) == 1024 and math.isfinite(run.time)
    assert 2 * 1023 * 2 <= run.messages <= 2 * 1024 * 4  # up and down both trees, a few segments


@pytest.mark.parametrize("algorithm", allreduce_algorithms())
@pytest.mark.parametrize(("nodes", "per_node", "nbytes"), [(2, 3, 4004), (3, 2, 3 << 16), (2, 4, 1 << 20)])
def test_one_thread_driver_matches_a_thread_per_rank(algorithm: str, nodes: int, per_node: int, nbytes: int) -> None:
    """Generators on one thread and a blocking thread per rank give the same results, virtual
    times (to the last bit) and message counts, contended NICs and gammas included."""
    shape = cluster(nodes, per_node, nic_bandwidth=1.5e8, gamma=1e-10)
    steps = simulate_allreduce(shape, algorithm, nbytes, timing_only=False, segment_bytes=4096)
    threads = simulate_allreduce(shape, algorithm, nbytes, timing_only=False, segment_bytes=4096, threaded=True)
    assert steps.finish_times == threads.finish_times and steps.messages == threads.messages
    for mine, theirs in zip(steps.results, threads.results):
        np.testing.assert_array_equal(mine, theirs)


def test_generator_ranks_cost_what_threads_cost() -> None:
    """`simulate_steps` resumes a rank with the index of the first completed request it yielded."""

    def body(t: SimulatedTransport) -> RankSteps[tuple[int, float]]:
        buf = t.empty(1000, np.uint8)
        if t.rank == 0:
            slow, fast = t.isend(buf, 2, 0, H), t.isend(buf, 1, 0, H)
            first = yield [slow, fast]
            yield [slow]
            return first, t.clock()
        if t.rank < 3:
            yield [t.irecv(buf, 0, 0, H)]
        return 0, t.clock()

    run = simulate_steps(body, cluster(2, 2), timing_only=True)
    intra = INTRA.alpha + 1000 / INTRA.bandwidth
    inter = INTER.alpha + 1000 / INTER.bandwidth
    assert run.results[0][0] == 1
    assert run.finish_times == pytest.approx((inter, intra, inter, 0.0))


def test_generator_ranks_report_failures() -> None:
    """Under `simulate_steps` a deadlock and a mismatch raise as under threads, and a rank that
    blocks its thread instead of yielding is told to yield."""

    def deadlock(t: SimulatedTransport) -> RankSteps[None]:
        if t.rank == 0:
            yield [t.irecv(t.empty(1, np.uint8), 1, 0, H)]

    with pytest.raises(CollectiveTimeoutError, match="simulated deadlock"):
        simulate_steps(deadlock, cluster(1, 2))

    def mismatch(t: SimulatedTransport) -> RankSteps[None]:
        buf = t.empty(1, np.uint8)
        yield [t.isend(buf, 1, 0, b"allreduce") if t.rank == 0 else t.irecv(buf, 0, 0, b"barrier")]

    with pytest.raises(MismatchError, match="barrier"):
        simulate_steps(mismatch, cluster(1, 2))

    def blocking(t: SimulatedTransport) -> RankSteps[None]:
        t.irecv(t.empty(1, np.uint8), 1 - t.rank, 0, H).wait(None)
        yield []

    with pytest.raises(RuntimeError, match="yield"):
        simulate_steps(blocking, cluster(1, 2))


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


@pytest.mark.parametrize("size", [1, 2, 5, 8])
def test_broadcast_and_barrier_run_on_both_drivers(size: int) -> None:
    """The broadcast and the barrier are step machines like the all-reduces: on the one-thread
    simulated driver and on the blocking driver with a thread per rank they give the root's data
    everywhere, the same virtual times to the last bit and the same message counts."""
    shape = Cluster(1, size, INTRA, INTER, gamma=1e-10)
    root = 2 % size

    def start(t: SimulatedTransport) -> tuple[Group, Steps, np.ndarray]:
        group = Group(t, tuple(range(t.size)), collective_tags(0, "broadcast, then barrier"), H, math.inf, math.inf)
        buf = t.empty(3001, np.float32)
        buf[...] = t.rank + 1

        def steps() -> Steps:
            yield from tree_broadcast_steps(group, buf, root, segment_bytes=1024)
            yield from dissemination_barrier_steps(group)

        return group, steps(), buf

    def one_thread(t: SimulatedTransport) -> RankSteps[np.ndarray]:
        _, steps, buf = start(t)
        yield from rank_steps(steps)
        return buf.view(np.ndarray)

    def blocking(t: SimulatedTransport) -> np.ndarray:
        group, steps, buf = start(t)
        drive(group, steps)
        return buf.view(np.ndarray)

    stepped, threaded = simulate_steps(one_thread, shape), simulate(blocking, shape)
    assert stepped.finish_times == threaded.finish_times and stepped.messages == threaded.messages
    for result in stepped.results + threaded.results:
        np.testing.assert_array_equal(result, np.full(3001, root + 1, np.float32))


def test_one_thread_driver_raises_a_failed_wait_inside_the_machine() -> None:
    """As the blocking driver does, the simulated one raises a failed operation's error where the
    machine waited: a machine that catches the mismatch ends normally."""

    def body(t: SimulatedTransport) -> RankSteps[str]:
        header = b"allreduce op=sum" if t.rank == 0 else b"allreduce op=max"
        group = Group(t, (0, 1), collective_tags(0, "mismatched"), header, math.inf, math.inf)
        caught = []

        def steps() -> Steps:
            tag = group.tags.allocator().tag("exchange")
            buf = t.empty(1, np.uint8)
            try:
                yield from wait_all([group.irecv(buf, 1 - t.rank, tag), group.isend(buf, 1 - t.rank, tag)])
            except MismatchError as error:
                caught.append(str(error))

        yield from rank_steps(steps())
        return caught[0]

    for message in simulate_steps(body, cluster(1, 2)).results:
        assert "op=sum" in message and "op=max" in message
