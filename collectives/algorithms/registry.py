"""The all-reduce algorithm registry: the one list of algorithms everything else reads.

Each algorithm module ends with one `register(AllReduceAlgorithm(...))` naming its step machine, its
cost function (built from the same segmentation rule as its code, so the model cannot drift from
what runs), and where it applies. Dispatch (`allreduce_steps`), `algorithm="auto"` and `explain()`
(`collectives.selection.selector`), the simulator harness, `python -m bench -a` and the algorithm
table in docs/architecture.md all read this registry; nothing else lists algorithm names.

Adding an algorithm is one new module that registers itself, imported once before use::

    register(AllReduceAlgorithm(
        name="halving_doubling",
        summary="recursive halving reduce-scatter, recursive doubling all-gather",
        steps=halving_doubling_steps,          # (group, nodes, src, dst, op, segment_bytes) -> Steps
        cost=halving_doubling_cost,            # (nbytes, topology, costs, segment_bytes) -> seconds
        runs_on=lambda topology: topology.size & (topology.size - 1) == 0,
    ))

The library's own algorithms register when `collectives.algorithms` is imported (its `__init__`).
An algorithm with options registers its default form once and builds the others from their names
(`AllReduceAlgorithm.variant`: "parameter_server_2" is the parameter server with two servers).

Cost functions share one notation (each algorithm's module docstring gives its formula): n bytes
per rank, p ranks on N nodes of L ranks, s the segment size, t(m) = alpha + m beta the time of one
m-byte message on a link (`LinkCost.time`), gamma the reduction time per byte. A link is `intra`
inside a node; between nodes it is `inter`, and k flows leaving one node at once share its NIC:
t(m) = max(alpha + m beta_inter, m k nic_beta) (`LinkCosts.inter_flow`). Every message also pays
alpha on its sender, so a stream of S segments costs S t(m/S), not t(m) + (S-1) m/S beta
(`layout.stream_pieces`). The simulated backend checks the model: on its grid of clusters the
choice it makes is within a few percent of the best algorithm (docs/selector.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from collectives.core.group import Group
from collectives.core.ops import ReduceOp
from collectives.core.schedule import Steps
from collectives.core.topology import LinkCosts, Topology

AllReduceSteps = Callable[[Group, Sequence[Sequence[int]], np.ndarray, np.ndarray, ReduceOp, int], Steps]
"""steps(group, nodes, src, dst, op, segment_bytes): the algorithm's step machine (`core.schedule`).
`nodes` lists the member indices of each node; `src` may be `dst`."""

CostFunction = Callable[[int, Topology, LinkCosts, int], float]
"""cost(nbytes, topology, link_costs, segment_bytes): predicted seconds of one all-reduce of
`nbytes` per rank (`nbytes > 0`, at least two ranks)."""


FlatSteps = Callable[..., Steps]
"""steps(group, src, dst, op, *, segment_bytes): the step machine of an algorithm that does not
look at the node layout."""


def ignoring_nodes(steps: FlatSteps) -> AllReduceSteps:
    """The registry's form of a step machine that does not look at the node layout."""

    def with_nodes(
        group: Group, nodes: Sequence[Sequence[int]], src: np.ndarray, dst: np.ndarray, op: ReduceOp, segment_bytes: int
    ) -> Steps:
        return steps(group, src, dst, op, segment_bytes=segment_bytes)

    return with_nodes


def _everywhere(topology: Topology) -> bool:
    return True


def _every_rank(size: int) -> int:
    return size


@dataclass(frozen=True)
class AllReduceAlgorithm:
    """One all-reduce algorithm, as every part of the library sees it."""

    name: str
    summary: str
    """One line for tables: what the algorithm does."""
    steps: AllReduceSteps
    cost: CostFunction
    runs_on: Callable[[Topology], bool] = _everywhere
    """Whether it can run on a topology at all (world size, node layout); asked for elsewhere it
    is refused with a ValueError."""
    auto_candidate: Callable[[Topology], bool] | None = _everywhere
    """Where `auto` considers it (within `runs_on`); None: never (a test oracle, say)."""
    contributors: Callable[[int], int] = _every_rank
    """How many of `size` ranks contribute their input, the count a mean divides by: all of them,
    except where some ranks only serve (dedicated parameter servers)."""
    variant: Callable[[str], AllReduceAlgorithm | None] | None = None
    """For an algorithm with options: the entry of the variant a longer name spells (given
    "parameter_server_2_greedy", the parameter server with two servers placed greedily), or None if
    the name spells none. Every process finds a variant from its name alone, and the name travels in
    every header, so ranks asking for different options get a `MismatchError`. Variants are not
    listed (`names`, `auto`, the table): those show the algorithm's default form."""


_REGISTRY: dict[str, AllReduceAlgorithm] = {}
_VARIANTS: dict[str, AllReduceAlgorithm] = {}
"""The variants looked up so far, by name."""


def register(algorithm: AllReduceAlgorithm) -> AllReduceAlgorithm:
    """Add `algorithm` to the registry; a name can be registered only once."""
    reserved = ("auto", "native")
    if algorithm.name in reserved or not algorithm.name.isidentifier():
        raise ValueError(f"algorithm name must be an identifier other than {reserved}, got {algorithm.name!r}")
    if algorithm.name in _REGISTRY:
        raise ValueError(f"an all-reduce algorithm named {algorithm.name!r} is already registered")
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def unregister(name: str) -> None:
    """Remove the algorithm registered as `name` (tests and plug-ins that are unloaded)."""
    lookup(name)
    del _REGISTRY[name]
    for variant in [variant for variant in _VARIANTS if variant.startswith(f"{name}_")]:
        del _VARIANTS[variant]


def names() -> tuple[str, ...]:
    """Every registered all-reduce algorithm, in registration order."""
    return tuple(_REGISTRY)


def lookup(name: str) -> AllReduceAlgorithm:
    """The algorithm registered as `name` or the variant it names, or a ValueError listing the
    algorithms there are."""
    algorithm = _REGISTRY.get(name) or _VARIANTS.get(name) or _variant(name)
    if algorithm is None:
        raise ValueError(
            f"unknown all-reduce algorithm {name!r}; expected one of {', '.join(map(repr, _REGISTRY))}, "
            f"'auto', or 'native' on a backend with its own all-reduce"
        )
    return algorithm


def _variant(name: str) -> AllReduceAlgorithm | None:
    """The variant `name` spells of a registered algorithm with variants, remembered; or None."""
    for family in _REGISTRY.values():
        if family.variant is not None and name.startswith(f"{family.name}_"):
            algorithm = family.variant(name)
            if algorithm is not None:
                _VARIANTS[name] = algorithm
                return algorithm
    return None


def runnable(name: str, topology: Topology) -> AllReduceAlgorithm:
    """`lookup(name)`, refused with a ValueError where the algorithm cannot run on `topology`."""
    algorithm = lookup(name)
    if not algorithm.runs_on(topology):
        raise ValueError(
            f"all-reduce algorithm {name!r} cannot run on {topology.size} ranks on {topology.num_nodes} "
            f"node(s) {[len(ranks) for ranks in topology.nodes]}"
        )
    return algorithm


def auto_candidates(topology: Topology) -> tuple[str, ...]:
    """The algorithms `auto` chooses from on `topology`, in registration order (ties go to the
    earlier one)."""
    return tuple(
        name
        for name, algorithm in _REGISTRY.items()
        if algorithm.auto_candidate is not None and algorithm.runs_on(topology) and algorithm.auto_candidate(topology)
    )


def contenders() -> tuple[str, ...]:
    """The algorithms `auto` considers on some topology: what a side-by-side comparison shows."""
    return tuple(name for name, algorithm in _REGISTRY.items() if algorithm.auto_candidate is not None)


def predict(name: str, nbytes: int, topology: Topology, costs: LinkCosts, segment_bytes: int) -> float:
    """Predicted seconds of one all-reduce of `nbytes` per rank with algorithm `name`."""
    if topology.size == 1 or nbytes <= 0:
        return 0.0
    return lookup(name).cost(nbytes, topology, costs, segment_bytes)


def allreduce_steps(
    name: str,
    group: Group,
    nodes: Sequence[Sequence[int]],
    src: np.ndarray,
    dst: np.ndarray,
    op: ReduceOp,
    *,
    segment_bytes: int,
) -> Steps:
    """dst = op over all members of src with algorithm `name`, as a step machine; checks `name`
    when called. `schedule.drive` runs it blocking, the simulator on its virtual clock."""
    return lookup(name).steps(group, nodes, src, dst, op, segment_bytes)


def markdown_table() -> str:
    """The registered algorithms as the Markdown table docs/architecture.md shows."""
    rows = ["| algorithm | what it does | auto considers it |", "|---|---|---|"]
    for algorithm in _REGISTRY.values():
        auto = "never" if algorithm.auto_candidate is None else "yes"
        rows.append(f"| `{algorithm.name}` | {algorithm.summary} | {auto} |")
    return "\n".join(rows)
