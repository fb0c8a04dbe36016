"""The algorithm registry: adding an algorithm is one module plus its registry entry.

The toy algorithm below lives only in this test module. Registered, it runs through the
communicator, shows in `explain()`, is an `auto` candidate and is measured by `python -m bench -a`,
without any other file naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

import collectives
from collectives.algorithms import registry
from collectives.algorithms.registry import AllReduceAlgorithm
from collectives.bench.commands import main as bench_main
from collectives.core.group import Group
from collectives.core.ops import ReduceOp, combine, finalize
from collectives.core.schedule import Steps, wait_all
from collectives.core.topology import LinkCosts, Topology

TOY = "direct_exchange"


def direct_exchange_steps(
    group: Group, nodes: Sequence[Sequence[int]], src: np.ndarray, dst: np.ndarray, op: ReduceOp, segment_bytes: int
) -> Steps:
    """Every member sends its whole buffer to every other and reduces all of them in rank order."""
    p, me = group.size, group.rank
    tag = group.tags.allocator().tag("direct exchange")
    inbox = np.empty((p, src.size), dtype=src.dtype)
    receives = [group.irecv(inbox[peer], peer, tag) for peer in range(p) if peer != me]
    sends = [group.isend(src, peer, tag) for peer in range(p) if peer != me]
    yield from wait_all(receives)
    inbox[me] = src
    dst[...] = inbox[0]
    for peer in range(1, p):
        combine(op, dst, inbox[peer], out=dst)
    finalize(op, dst, p)
    yield from wait_all(sends)


def direct_exchange_cost(nbytes: int, topology: Topology, costs: LinkCosts, segment_bytes: int) -> float:
    """Free, so that `auto` picks it: the test is about being seen, not about the model."""
    return 0.0


@pytest.fixture
def toy() -> Iterator[AllReduceAlgorithm]:
    algorithm = registry.register(
        AllReduceAlgorithm(
            name=TOY,
            summary="every rank sends its buffer to every other",
            steps=direct_exchange_steps,
            cost=direct_exchange_cost,
        )
    )
    try:
        yield algorithm
    finally:
        registry.unregister(TOY)


def test_a_registered_algorithm_runs_is_explained_and_chosen_by_auto(toy: AllReduceAlgorithm) -> None:
    assert TOY in collectives.allreduce_algorithms()

    def body(comm: collectives.Communicator) -> tuple:
        x = np.arange(10, dtype=np.float64) * (comm.rank + 1)
        explicit = comm.allreduce(x, algorithm=TOY)
        chosen = comm.allreduce(x)
        return explicit, chosen, comm.last_algorithm, comm.explain(x.nbytes), comm.algorithms

    results = collectives.run_threads(body, world_size=3)
    expected = np.arange(10, dtype=np.float64) * 6
    for explicit, chosen, last, explanation, algorithms in results:
        np.testing.assert_array_equal(explicit, expected)
        np.testing.assert_array_equal(chosen, expected)
        assert last == TOY and explanation.choice == TOY and TOY in explanation.predicted
        assert TOY in str(explanation) and TOY in algorithms


def test_bench_measures_a_registered_algorithm(toy: AllReduceAlgorithm, capsys: pytest.CaptureFixture) -> None:
    status = bench_main(["-n", "3", "-a", f"{TOY},ring", "-b", "4K", "-e", "4K", "-w", "0", "-i", "1", "--no-tune"])
    out = capsys.readouterr().out
    assert status == 0
    rows = [line.split() for line in out.splitlines() if TOY in line.split()]
    assert rows, out
    assert all(row[-1] == "0" for row in rows), out  # the #wrong column


def test_auto_candidates_follow_the_registry(toy: AllReduceAlgorithm) -> None:
    flat = Topology(("a",) * 4)
    nodes = Topology(("a", "a", "b", "b"))
    assert registry.auto_candidates(flat) == ("direct", "ring", "tree", TOY)
    assert registry.auto_candidates(nodes) == (
        "direct",
        "ring",
        "tree",
        "hierarchical",
        "hierarchical_tree",
        "parameter_server",
        TOY,
    )
    assert "reference" not in registry.contenders() and TOY in registry.contenders()


def test_registering_and_asking_for_names_is_checked(toy: AllReduceAlgorithm) -> None:
    with pytest.raises(ValueError, match="already registered"):
        registry.register(toy)
    for bad in ("auto", "native", "not a name"):
        with pytest.raises(ValueError, match="identifier"):
            registry.register(AllReduceAlgorithm(bad, "", direct_exchange_steps, direct_exchange_cost))
    expected = "unknown all-reduce algorithm 'nope'; expected one of 'direct', 'ring', 'tree'"
    with pytest.raises(ValueError, match=expected):
        registry.lookup("nope")


def test_an_algorithm_is_refused_where_it_cannot_run() -> None:
    registry.register(
        AllReduceAlgorithm(
            name="pairs_only",
            summary="needs an even world",
            steps=direct_exchange_steps,
            cost=direct_exchange_cost,
            runs_on=lambda topology: topology.size % 2 == 0,
        )
    )
    try:
        assert registry.auto_candidates(Topology(("a",) * 3)) == ("direct", "ring", "tree")

        def body(comm: collectives.Communicator) -> str:
            with pytest.raises(ValueError, match="'pairs_only' cannot run on 3 ranks"):
                comm.allreduce(np.ones(4), algorithm="pairs_only")
            comm.allreduce(np.ones(4))
            return comm.last_algorithm or ""

        assert set(collectives.run_threads(body, world_size=3)) <= {"direct", "ring", "tree", collectives.NATIVE}
    finally:
        registry.unregister("pairs_only")


def test_the_architecture_page_shows_the_registry() -> None:
    """docs/architecture.md's algorithm table is `registry.markdown_table()`, regenerated when an
    algorithm is added (copy the output of `python -c "from collectives.algorithms import registry;
    print(registry.markdown_table())"`)."""
    page = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    table = re.search(r"^\| algorithm \|.*?(?=\n\n|\Z)", page, flags=re.M | re.S)
    assert table is not None and table.group(0).strip() == registry.markdown_table()
