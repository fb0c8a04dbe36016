"""Data-parallel training efficiency against rank count, from all-reduce times.

The question a user of this library asks before buying a cluster is "how much of my GPUs' time
goes to waiting on the network?". This module answers it for one training step with a simple,
stated model, so the answer can be checked against the published one (the Horovod paper:
InceptionV3 keeps ~90% efficiency at 8 ranks per node over fast links, while one rank per node on
10 Gb/s falls to ~50%).

The step (`TrainingModel`):

    |-- forward (1/3 T) --|------------ backprop (2/3 T) ------------|
                           gradients become ready uniformly, last layer first;
                           every 25 MiB of them form a bucket, all-reduced as soon as it is full,
                           one bucket at a time, in order
                                       [bucket 1][bucket 2][bucket 3]  [b4]..exposed..|

Communication hides behind backprop as long as it keeps up; what runs past the end of compute is
exposed. efficiency = T / (T + exposed). The last bucket is ready only at T, so its all-reduce is
always exposed: that is what keeps even a fast cluster below 100%.

All-reduce times come from the cost model (each algorithm's cost function in
`collectives.algorithms.registry`; any rank count, microseconds to compute) or from the simulated
backend (`collectives.selection.simulation`, the real algorithm code on a virtual clock, 12-20 us of
real time per message, the runs spread over the machine's CPUs: a 25 MiB flat ring all-reduce sends
2p(p-1) messages, about a quarter of a second at 128 ranks and under a minute at 1024), and
`auto` is what the selector picks for each bucket size from the cluster's own link costs (what
probes measure on it: the simulator's probes recover them to 0.02%).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from collectives.algorithms.registry import predict
from collectives.backends.simulated import Cluster, Link
from collectives.core.layout import DEFAULT_SEGMENT_BYTES
from collectives.core.topology import LinkCost, LinkCosts, Topology
from collectives.selection.selector import Selector
from collectives.selection.simulation import simulated_times

from .measure import OUT_OF_PLACE, SweepSpec
from .run import on_threads, rank_sweep

INCEPTION_V3_PARAMETERS = 23_851_784
"""Trainable parameters of Keras' InceptionV3 (float32 gradients: 95.4 MB per step)."""

SCALING_ALGORITHMS = ("ring", "hierarchical", "auto")
"""Flat ring against the hierarchical algorithm, and what auto makes of the choice."""

RANK_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class TrainingModel:
    """One data-parallel training step of a model, as far as communication is concerned.

    Attributes:
        parameters: float32 parameters, hence gradient elements to all-reduce each step.
        compute_seconds: forward + backward time of one step on one GPU. 0.12 s is InceptionV3 at
            batch 32 on a V100-class GPU (about 270 images/s).
        backprop_fraction: the share of compute that produces gradients (backprop is about twice
            the forward pass).
        bucket_bytes: gradients are all-reduced in buckets of this size (Horovod's tensor fusion,
            PyTorch DDP's 25 MiB).
    """

    parameters: int = INCEPTION_V3_PARAMETERS
    compute_seconds: float = 0.12
    backprop_fraction: float = 2 / 3
    bucket_bytes: int = 25 << 20

    @property
    def gradient_bytes(self) -> int:
        return self.parameters * 4

    def buckets(self) -> list[int]:
        """Bucket sizes in bytes, in the order they fill (whole float32 elements)."""
        full, rest = divmod(self.gradient_bytes, self.bucket_bytes)
        return [self.bucket_bytes] * full + ([rest] if rest else [])

    def exposed_seconds(self, allreduce_seconds: Callable[[int], float]) -> float:
        """Communication time not hidden behind compute, given each bucket size's all-reduce time."""
        total = self.gradient_bytes
        backprop_start = (1 - self.backprop_fraction) * self.compute_seconds
        produced = 0
        busy_until = 0.0
        for size in self.buckets():
            produced += size
            ready = backprop_start + self.backprop_fraction * self.compute_seconds * produced / total
            busy_until = max(ready, busy_until) + allreduce_seconds(size)
        return max(0.0, busy_until - self.compute_seconds)

    def efficiency(self, allreduce_seconds: Callable[[int], float]) -> float:
        """compute / (compute + exposed communication)."""
        return self.compute_seconds / (self.compute_seconds + self.exposed_seconds(allreduce_seconds))


@dataclass(frozen=True)
class ClusterKind:
    """A family of clusters (one per rank count) sharing node size and links."""

    name: str
    ranks_per_node: int
    intra: Link
    inter: Link
    nic_bandwidth: float
    gamma: float
    """Reduction seconds per byte."""

    def cluster(self, ranks: int) -> Cluster:
        if ranks % self.ranks_per_node:
            raise ValueError(f"{ranks} ranks do not fill nodes of {self.ranks_per_node}")
        return Cluster(
            ranks // self.ranks_per_node, self.ranks_per_node, self.intra, self.inter, self.nic_bandwidth, self.gamma
        )

    def link_costs(self) -> LinkCosts:
        """The cost model's parameters for these links: what `comm.probe()` would measure."""
        return LinkCosts(
            intra=LinkCost(self.intra.alpha, 1 / self.intra.bandwidth),
            inter=LinkCost(self.inter.alpha, 1 / self.inter.bandwidth),
            nic_beta=1 / self.nic_bandwidth,
            gamma=self.gamma,
            measured=True,
        )


GPU_NODES = ClusterKind(
    name="8 ranks/node, NVLink 150 GB/s + 100 Gb/s NIC",
    ranks_per_node=8,
    intra=Link(3e-6, 150e9),
    inter=Link(10e-6, 12.5e9),
    nic_bandwidth=12.5e9,
    gamma=1 / 200e9,
)
"""DGX-like nodes: 8 GPUs on NVLink (3 us, 150 GB/s), one 100 Gb/s NIC per node (10 us per message);
reductions at GPU memory speed (200 GB/s)."""

ETHERNET_NODES = ClusterKind(
    name="1 rank/node, 10 Gb/s Ethernet",
    ranks_per_node=1,
    intra=Link(3e-6, 150e9),
    inter=Link(50e-6, 1.25e9),
    nic_bandwidth=1.25e9,
    gamma=1 / 200e9,
)
"""One GPU per machine on 10 Gb/s TCP (50 us per message): the setting where the Horovod paper saw
~50% efficiency."""

CLUSTER_KINDS = (GPU_NODES, ETHERNET_NODES)


@dataclass(frozen=True)
class ScalingPoint:
    """Efficiency of one (cluster kind, algorithm, rank count), and where its times came from."""

    cluster: str
    algorithm: str
    ranks: int
    efficiency: float
    source: str
    """"model" (cost model), "simulated" (simulated backend) or "measured" (a real backend)."""
    choices: tuple[str, ...] = field(default=())
    """For auto: the algorithm chosen for each bucket size."""


def resolve(kind: ClusterKind, ranks: int, algorithm: str, nbytes: int) -> str:
    """The algorithm that runs: auto resolved through the selector with the cluster's link costs."""
    if algorithm != "auto":
        return algorithm
    return Selector(Topology(kind.cluster(ranks).hosts), kind.link_costs(), DEFAULT_SEGMENT_BYTES).choose(nbytes)


def scaling_curve(
    kind: ClusterKind,
    algorithm: str,
    model: TrainingModel,
    rank_counts: Iterable[int] = RANK_COUNTS,
    *,
    simulated: bool = False,
) -> list[ScalingPoint]:
    """Efficiency at each rank count (those that fill whole nodes of `kind`), from the model or
    from the simulated backend (its runs spread over this machine's CPUs)."""
    sizes = sorted(set(model.buckets()))
    counts = [ranks for ranks in rank_counts if ranks % kind.ranks_per_node == 0]
    runs = {
        (ranks, size): (kind.cluster(ranks), resolve(kind, ranks, algorithm, size), size)
        for ranks in counts
        for size in sizes
    }
    if simulated:
        simulated_seconds = simulated_times(runs.values())
        seconds = {key: simulated_seconds[run] for key, run in runs.items()}
    else:
        seconds = {
            key: predict(chosen, size, Topology(cluster.hosts), kind.link_costs(), DEFAULT_SEGMENT_BYTES)
            for key, (cluster, chosen, size) in runs.items()
        }
    return [
        ScalingPoint(
            cluster=kind.name,
            algorithm=algorithm,
            ranks=ranks,
            efficiency=model.efficiency({size: seconds[ranks, size] for size in sizes}.__getitem__),
            source="simulated" if simulated else "model",
            choices=tuple(runs[ranks, size][1] for size in sizes) if algorithm == "auto" else (),
        )
        for ranks in counts
    ]


def measured_curve(
    rank_counts: Iterable[int], model: TrainingModel, ranks_per_node: int = 2, iterations: int = 3
) -> list[ScalingPoint]:
    """Efficiency from all-reduce times measured on thread ranks of this machine.

    The same step model, fed with real (median, slowest-rank) bucket all-reduce times instead of
    modelled ones. On a laptop-sized machine this measures the machine, not a GPU cluster: it shows
    how far the threads backend is from hiding behind a GPU's compute, nothing more.
    """
    sizes = tuple(sorted(set(model.buckets())))
    algorithms = SCALING_ALGORITHMS
    spec = SweepSpec("allreduce", sizes, algorithms, warmup=1, iterations=iterations, placements=(OUT_OF_PLACE,))
    points = []
    for ranks in rank_counts:
        result = on_threads(rank_sweep(spec, progress=False), ranks, ranks_per_node)
        for algorithm in algorithms:
            times = {r.nbytes: r.seconds for r in result.rows if r.algorithm == algorithm}
            choices = tuple(result.choices[size] for size in sizes) if algorithm == "auto" else ()
            points.append(
                ScalingPoint(
                    f"threads backend on this machine, {ranks_per_node} ranks/node",
                    algorithm,
                    ranks,
                    model.efficiency(times.__getitem__),
                    "measured",
                    choices,
                )
            )
    return points


def format_scaling(points: Sequence[ScalingPoint]) -> str:
    """One line per point: cluster, algorithm, source, ranks, efficiency (and auto's choices)."""
    lines = [f"{'cluster':<46} {'algorithm':>12} {'source':>9} {'ranks':>6} {'efficiency':>10}  auto picks"]
    for point in points:
        lines.append(
            f"{point.cluster:<46} {point.algorithm:>12} {point.source:>9} {point.ranks:>6} "
            f"{point.efficiency * 100:>9.1f}%  {','.join(point.choices)}"
        )
    return "\n".join(lines)
