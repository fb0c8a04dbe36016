"""`python -m bench --backend simulated`: every algorithm's simulated time beside the model's
prediction and the auto choice, on a cluster described on the command line.

The selector works from link costs probed on the simulated cluster (as it would on a real one), so
the table shows the whole chain: probes -> model -> choice, against the simulated truth. `regret` is
how much slower the chosen algorithm is than the fastest one at that size.
"""

from __future__ import annotations

import math
from typing import Sequence

from backends.simulated import Cluster, SimulatedTransport, simulate
from collectives.group import Group
from collectives.layout import DEFAULT_SEGMENT_BYTES
from collectives.probe import probe_links
from collectives.selector import Selector
from collectives.simulation import simulate_allreduce
from collectives.topology import LinkCosts, Topology


def probe_cluster(cluster: Cluster) -> LinkCosts:
    """The link costs the probes measure on `cluster` (identical on every rank; rank 0's)."""
    topology = Topology(cluster.hosts)

    def body(transport: SimulatedTransport) -> LinkCosts:
        group = Group(transport, tuple(range(transport.size)), 64, b"probe", math.inf, math.inf)
        return probe_links(group, topology)

    return simulate(body, cluster).results[0]


def regret_table(cluster: Cluster, sizes: Sequence[int], segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> tuple[str, float]:
    """(the table, the largest regret over `sizes`)."""
    costs = probe_cluster(cluster)
    selector = Selector(Topology(cluster.hosts), costs, segment_bytes)
    lines = [
        f"# probed: intra {costs.intra.alpha * 1e6:.2f} us {1 / costs.intra.beta / 1e9:.2f} GB/s, "
        f"inter {costs.inter.alpha * 1e6:.2f} us {1 / costs.inter.beta / 1e9:.2f} GB/s, "
        f"NIC {1 / costs.nic_beta / 1e9:.2f} GB/s, gamma {1 / costs.gamma / 1e9:.2f} GB/s",
        f"{'size':>12} {'algorithm':>18} {'simulated(us)':>14} {'model(us)':>12} {'auto':>5} {'best':>5}",
    ]
    worst = 0.0
    for nbytes in sizes:
        simulated = {a: simulate_allreduce(cluster, a, nbytes, segment_bytes=segment_bytes).time for a in selector.candidates}
        predicted = selector.predictions(nbytes)
        choice, best = selector.choose(nbytes), min(simulated, key=simulated.__getitem__)
        regret = simulated[choice] / simulated[best] - 1
        worst = max(worst, regret)
        for algorithm in selector.candidates:
            lines.append(
                f"{nbytes:>12} {algorithm:>18} {simulated[algorithm] * 1e6:>14.1f} {predicted[algorithm] * 1e6:>12.1f} "
                f"{'*' if algorithm == choice else '':>5} {'*' if algorithm == best else '':>5}"
            )
        lines.append(f"{nbytes:>12} {'regret':>18} {regret * 100:>13.1f}%")
    return "\n".join(lines), worst
