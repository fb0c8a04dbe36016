"""`python -m bench --emulate-nodes N`: several nodes on one Linux machine, one network namespace each.

Hierarchical all-reduce only pays off where the links between nodes are slower than those inside a
node, which ranks talking over one machine's loopback cannot show. `EmulatedCluster` builds such a
cluster on one machine (as root), and `run_on_emulated_nodes` runs the gRPC ranks of the benchmark
on it:

    coll-<pid>-n0  10.231.0.1                  coll-<pid>-hub                  coll-<pid>-n1  10.231.0.2
    ranks 0, 1 (over lo)                  ┌────────── br0 ──────────┐          ranks 2, 3 (over lo)
                 eth0 ==tbf==>  <==tbf== p0                         p1 ==tbf==>  <==tbf== eth0
                      └──────── veth ──────┘                         └──────── veth ────────┘

* One namespace per node. Its ranks listen on the node's address, so ranks of one node talk over
  the namespace's loopback (fast), and they share a node in the topology because the gRPC backend
  takes a rank's node identity from the host part of its address (no COLLECTIVES_RANKS_PER_NODE).
* A hub namespace with a bridge joins the nodes, one veth pair per node, for any N >= 2 alike.
* A token-bucket filter (`tc qdisc ... tbf`) limits each node's link in both directions, on the
  node's end (leaving the node) and on the hub's end (entering it), as a NIC on a switch port
  would. Only the rate is shaped: netem (delay) is not available in every kernel.

Everything lives inside namespaces this process creates, named after its pid: the machine's own
interfaces, addresses and routes are never touched, and the private subnet cannot collide with
anything outside them. Deleting a namespace deletes its veth ends and qdiscs, so cleanup is one
`ip netns delete` per namespace this instance created, run when the `with` block ends however it
ends (SIGTERM and SIGHUP become SystemExit for that; while ranks run, the launcher's supervision
takes the signal, stops them and returns) and from atexit as a last resort.

Without root, `ip` or `tc` (or grpcio), `resolve_arguments` says why in one line and runs the
equivalent simulated cluster instead (`--backend simulated`, collectives.bench.simulated).
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from collectives.launch import grpc_rank_environments, run_ranks

from .cli import UsageError
from .measure import COPY_BOUND, OUT_OF_PLACE, SweepResult
from .output import result_from_dict

NAMESPACE_PREFIX = "coll-"
"""Every namespace created here is named `coll-<pid>-...`, the pid of the process that made it."""
SUBNET = ipaddress.IPv4Network("10.231.0.0/24")
"""Node i gets the (i+1)-th address; the subnet exists only inside the namespaces created here."""
FIRST_PORT = 29500
"""Local rank j of every node listens on FIRST_PORT + j (each namespace has its own ports)."""
COMMAND_TIMEOUT_SECONDS = 20.0
"""Bound on each `ip` / `tc` command."""
MAX_NODES = SUBNET.num_addresses - 2
TBF_LATENCY = "20ms"
"""How long a packet may wait in a token bucket's queue before it is dropped (TCP backs off)."""
TBF_MIN_BURST_BYTES = 128 * 1024
"""Room for two segmentation-offload packets (64 KiB plus headers each): a smaller bucket makes tbf
split every one, which on a 2-core machine halved the throughput of a 1 Gbit/s link (and made a
flat ring at 0.5 Gbit/s 1.7x slower than its bytes allow)."""

CommandRunner = Callable[[Sequence[str]], None]
"""Runs one `ip` / `tc` command; raises `NetnsError` naming the command when it fails."""


class NetnsError(RuntimeError):
    """Setting up, using or removing the emulated nodes failed; the message names the command."""


def run_command(command: Sequence[str]) -> None:
    """Run `command`, bounded by COMMAND_TIMEOUT_SECONDS; raise `NetnsError` with its output on failure."""
    try:
        finished = subprocess.run(
            list(command), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_SECONDS, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{shlex.join(command)}` did not finish within {COMMAND_TIMEOUT_SECONDS:g} s") from None
    except OSError as error:
        raise NetnsError(f"`{shlex.join(command)}` could not start: {error}") from None
    if finished.returncode != 0:
        output = (finished.stderr or finished.stdout).strip()
        raise NetnsError(f"`{shlex.join(command)}` failed with exit code {finished.returncode}: {output}")


def emulation_unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here, or None if they can."""
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid != 0:
        return f"emulated nodes need root to create network namespaces (running as uid {uid})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated nodes need {' and '.join(missing)} (iproute2), not found on PATH"
    if importlib.util.find_spec("grpc") is None:
        return "emulated nodes run the gRPC backend, and grpcio is not installed (pip install -e '.[grpc]')"
    return None


@dataclass(frozen=True)
class EmulatedNode:
    """One emulated node: its namespace and the address its ranks listen on."""

    index: int
    namespace: str
    address: str


class EmulatedCluster:
    """`nodes` network namespaces joined through a hub, each node's link limited to `inter_gbit`.

    Use as a context manager: the namespaces exist inside the `with` block only. `run` executes
    the `ip` / `tc` commands; tests pass a fake one to check cleanup without root.
    """

    def __init__(
        self, nodes: int, inter_gbit: float, *, run: CommandRunner = run_command, pid: int | None = None
    ) -> None:
        if not 2 <= nodes <= MAX_NODES:
            raise ValueError(f"emulated nodes: need 2 to {MAX_NODES} nodes, got {nodes}")
        if not inter_gbit > 0:
            raise ValueError(f"emulated nodes: the link rate must be positive, got {inter_gbit} Gbit/s")
        self.inter_gbit = inter_gbit
        self._run = run
        prefix = f"{NAMESPACE_PREFIX}{os.getpid() if pid is None else pid}-"
        self.hub = f"{prefix}hub"
        hosts = SUBNET.hosts()
        self.nodes = tuple(EmulatedNode(i, f"{prefix}n{i}", str(next(hosts))) for i in range(nodes))
        self.created: list[str] = []
        """Namespaces this instance created and has not removed yet, in creation order."""
        self._previous_handlers: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def __enter__(self) -> EmulatedCluster:
        atexit.register(self.cleanup)
        self._remove_on_signals()
        try:
            self.create()
        except BaseException:
            self._exit()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._exit()

    def create(self) -> None:
        """Create the hub, the nodes, their links and the rate limits; `created` tracks each namespace."""
        self._add_namespace(self.hub)
        self._run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        self._run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        for node in self.nodes:
            port = f"p{node.index}"
            self._add_namespace(node.namespace)
            self._run(["ip", "-n", node.namespace, "link", "set", "lo", "up"])
            self._run(
                [
                    "ip",
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    node.namespace,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "netns",
                    self.hub,
                ]
            )
            self._run(["ip", "-n", self.hub, "link", "set", port, "master", "br0"])
            self._run(["ip", "-n", self.hub, "link", "set", port, "up"])
            self._run(["ip", "-n", node.namespace, "addr", "add", f"{node.address}/{SUBNET.prefixlen}", "dev", "eth0"])
            self._run(["ip", "-n", node.namespace, "link", "set", "eth0", "up"])
            self._run(["tc", "-n", node.namespace, "qdisc", "add", "dev", "eth0", "root", *self._token_bucket()])
            self._run(["tc", "-n", self.hub, "qdisc", "add", "dev", port, "root", *self._token_bucket()])

    def cleanup(self) -> None:
        """Delete every namespace this instance created (which deletes their links and qdiscs).

        Tries all of them even when one fails, then raises `NetnsError` naming those left behind.
        Safe to call again: what is gone is no longer tracked.
        """
        failures = []
        for namespace in reversed(list(self.created)):
            try:
                self._run(["ip", "netns", "delete", namespace])
            except NetnsError as error:
                failures.append(str(error))
            else:
                self.created.remove(namespace)
        if failures:
            raise NetnsError(f"could not remove namespace(s) {', '.join(self.created)}: " + "; ".join(failures))

    def exec_command(self, node: EmulatedNode, command: Sequence[str]) -> list[str]:
        """`command` run inside `node`'s namespace."""
        return ["ip", "netns", "exec", node.namespace, *command]

    def describe(self) -> str:
        """One line saying what was built, for the benchmark's header."""
        names = ", ".join(f"{node.namespace} ({node.address})" for node in self.nodes)
        return (
            f"# emulated nodes: network namespaces {names}, joined through {self.hub}; "
            f"each node's link limited to {self.inter_gbit:g} Gbit/s each way (tc tbf), ranks of a node over loopback"
        )

    def _add_namespace(self, namespace: str) -> None:
        self._run(["ip", "netns", "add", namespace])
        self.created.append(namespace)  # only once it exists: never delete a name someone else owns

    def _token_bucket(self) -> list[str]:
        rate_bytes = self.inter_gbit * 1e9 / 8
        burst = max(TBF_MIN_BURST_BYTES, int(rate_bytes / 1000))  # a millisecond's worth, at least
        return ["tbf", "rate", f"{round(self.inter_gbit * 1e9)}bit", "burst", str(burst), "latency", TBF_LATENCY]

    def _remove_on_signals(self) -> None:
        """Turn SIGTERM and SIGHUP into SystemExit while the namespaces exist, so cleanup runs."""
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; atexit and __exit__ still clean up
        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[signum] = signal.signal(signum, _exit_on_signal)

    def _exit(self) -> None:
        try:
            self.cleanup()
        finally:
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
            self._previous_handlers.clear()
            atexit.unregister(self.cleanup)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def resolve_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """The benchmark's arguments for `--emulate-nodes`: gRPC ranks on emulated nodes, or, where
    namespaces cannot be made, the equivalent simulated cluster (saying why on stderr).

    Raises:
        UsageError: options that contradict each other or the emulation.
    """
    nodes = args.emulate_nodes
    if not 2 <= nodes <= MAX_NODES:
        raise UsageError(f"--emulate-nodes needs 2 to {MAX_NODES} nodes, got {nodes}")
    if args.backend not in ("threads", "grpc"):  # threads is the default, i.e. not chosen
        raise UsageError(f"--emulate-nodes runs the grpc backend, not --backend {args.backend}")
    if not args.inter_gbit > 0:
        raise UsageError(f"--inter-gbit must be positive, got {args.inter_gbit}")
    if args.ranks_per_node is not None and len(args.ranks_per_node) > 1:
        raise UsageError("--emulate-nodes makes nodes of equal size: give one number of ranks per node")
    per_node = args.ranks_per_node[0] if args.ranks_per_node else (args.ranks // nodes if args.ranks else 2)
    if per_node < 1 or (args.ranks is not None and args.ranks != nodes * per_node):
        raise UsageError(
            f"-n {args.ranks} does not make {nodes} nodes of {per_node} ranks (--emulate-nodes x --ranks-per-node)"
        )
    reason = emulation_unavailable_reason()
    if reason is None:
        return argparse.Namespace(
            **{**vars(args), "backend": "grpc", "ranks": nodes * per_node, "ranks_per_node": [per_node]}
        )
    from collectives.backends.simulated import Link

    bandwidth = args.inter_gbit * 1e9 / 8
    print(
        f"python -m bench: {reason}; running the equivalent simulated cluster instead (--backend simulated)",
        file=sys.stderr,
    )
    return argparse.Namespace(
        **{
            **vars(args),
            "backend": "simulated",
            "nodes": nodes,
            "ranks": None,  # the nodes say it
            "ranks_per_node": [per_node],
            "inter": Link(args.inter.alpha, bandwidth),
            "nic": bandwidth / 1e9,
        }
    )


def run_on_emulated_nodes(args: argparse.Namespace, argv: Sequence[str]) -> SweepResult | None:
    """Run `python -m bench argv` as the gRPC ranks of `args.emulate_nodes` emulated nodes.

    Returns rank 0's result, or None after saying on stderr what failed (a command, a rank).
    """
    try:
        with tempfile.TemporaryDirectory() as scratch, EmulatedCluster(args.emulate_nodes, args.inter_gbit) as cluster:
            print(cluster.describe(), flush=True)
            output_path = os.path.join(scratch, "result.json")
            code = _start_ranks_on_nodes(
                cluster, args.ranks_per_node[0], [*argv, "--worker-output", output_path], args.emulate_timeout
            )
            if code != 0 or not os.path.exists(output_path):
                print(
                    f"python -m bench: the ranks on the emulated nodes stopped with exit code {code}, no results",
                    file=sys.stderr,
                )
                return None
            with open(output_path) as stream:
                return result_from_dict(json.load(stream))
    except NetnsError as error:
        print(f"python -m bench: emulated nodes: {error}", file=sys.stderr)
        return None


def _start_ranks_on_nodes(
    cluster: EmulatedCluster, ranks_per_node: int, bench_arguments: Sequence[str], timeout: float
) -> int:
    """Start every rank inside its node's namespace, as the launcher would on one machine."""
    placement = [(node, local) for node in cluster.nodes for local in range(ranks_per_node)]
    addresses = [f"{node.address}:{FIRST_PORT + local}" for node, local in placement]
    command = [sys.executable, "-m", "collectives.bench", *bench_arguments]
    jobs = [
        (f"[{rank} {node.namespace}] ", cluster.exec_command(node, command), env)
        for rank, ((node, _), env) in enumerate(zip(placement, grpc_rank_environments(addresses)))
    ]
    return run_ranks(jobs, timeout)


def comparison(result: SweepResult) -> str:
    """Per size: hierarchical against ring, auto's choice, and the fastest algorithm measured
    (out-of-place times), after the link costs the selector worked from."""
    measured: dict[int, dict[str, float]] = {}
    for row in result.rows:
        if row.placement == OUT_OF_PLACE and row.algorithm not in (COPY_BOUND, "auto"):
            measured.setdefault(row.nbytes, {})[row.algorithm] = row.seconds
    lines = [f"# {result.link_costs}"] if result.link_costs else []
    for nbytes, times in measured.items():
        fastest = min(times, key=times.__getitem__)
        parts = [f"# {nbytes} bytes: fastest measured {fastest}"]
        if "ring" in times and "hierarchical" in times:
            parts.append(f"hierarchical {times['ring'] / times['hierarchical']:.2f}x as fast as ring")
        choice = result.choices.get(nbytes)
        if choice == fastest:
            parts.append(f"auto -> {choice} (the fastest)")
        elif choice in times:
            parts.append(f"auto -> {choice} ({times[choice] / times[fastest] - 1:+.1%} against the fastest)")
        elif choice is not None:
            parts.append(f"auto -> {choice} (not measured here)")
        lines.append("; ".join(parts))
    return "\n".join(lines)
