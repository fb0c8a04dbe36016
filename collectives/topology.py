"""Which ranks share a node.

Every rank learns every rank's `host` when its communicator is created, so all ranks build the same
`Topology` and therefore make the same algorithm decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Topology:
    """Node layout of a world: `hosts[rank]` names the node of each rank."""

    hosts: tuple[str, ...]
    nodes: tuple[tuple[int, ...], ...] = field(init=False)
    """Ranks of each node, nodes ordered by their lowest rank."""

    def __post_init__(self) -> None:
        by_host: dict[str, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            by_host.setdefault(host, []).append(rank)
        object.__setattr__(self, "nodes", tuple(tuple(ranks) for ranks in by_host.values()))

    @property
    def size(self) -> int:
        return len(self.hosts)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def node_of(self, rank: int) -> int:
        """Index of the node that `rank` runs on."""
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        """Position of `rank` among the ranks of its node."""
        return self.nodes[self.node_of(rank)].index(rank)

    def local_size(self, rank: int) -> int:
        """Number of ranks on the node of `rank`."""
        return len(self.nodes[self.node_of(rank)])

    @property
    def is_hierarchical(self) -> bool:
        """Several nodes, and at least one of them with several ranks."""
        return 1 < self.num_nodes < self.size
