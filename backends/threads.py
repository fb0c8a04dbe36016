"""In-process transport: every rank is a thread, messages are real copies between buffers.

All ranks of one world share a `ThreadFabric`. A send and a receive are matched by (source,
destination, tag) in posting order, exactly like MPI (`matching.Matcher`, whose unexpected
messages are the senders' requests themselves), and whichever of the two is posted second
copies the payload straight from the sender's buffer into the receiver's (one copy, no staging, and
numpy releases the GIL while it copies, so ranks really run in parallel). Nothing is shared between
ranks except through messages, so an algorithm that is correct here is correct over MPI.

The fabric is also where failures propagate: `abort` wakes every pending request of every rank with
the error, and later posts fail at once, which is how `run_threads` guarantees no rank hangs after
another one raised. An abort for a failed collective spares the operations of the collectives
before it (`abort_reaches`), so that a slower rank still finishing one of them can.

`ThreadTransport.dup` gives every rank an endpoint of a fabric of its own (`ThreadFabric.derived`),
which is how a communicator is duplicated.

Device arrays (CuPy) move the same way, device to device (`cudaMemcpyDefault` also crosses
devices, and host and device): posting a device buffer records an event on the poster's current
stream, the copy (or fused reduction) waits for both sides' events on a transfer stream, and the
requests complete only once it has finished on the GPU (`matching.receive_payload`,
`backends.device`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from .base import Consume, LockRequest, Transport, check_buffer, wait_first
from .device import Event, is_device, runtime
from .errors import (
    MismatchError,
    PeerLostError,
    abort_kind,
    abort_reaches,
    earlier_abort,
    error_from_abort,
    post_refusal,
)
from .matching import Matcher, check, receive_payload

_SEND = "send"
_RECV = "recv"
_AGREE = "header agreement"
_GATHER = "header gathering"

Receive = Callable[[list[np.ndarray]], None]
"""How a rank that joined an engine call takes every rank's contribution (`ThreadFabric.meet`)."""


class ThreadFabric:
    """The shared switchboard of one in-process world."""

    def __init__(self, hosts: Sequence[str]) -> None:
        if not hosts:
            raise ValueError("a fabric needs at least one rank")
        self.hosts = tuple(hosts)
        self.size = len(self.hosts)
        self._lock = threading.Lock()
        self._matcher: Matcher[tuple[int, int, int], LockRequest, LockRequest] = Matcher()
        """Keyed by (source, destination, tag). It holds every pending request: a request is
        completed as soon as it is matched."""
        self._closed: set[int] = set()
        self._abort: tuple[int, str, str] | None = None
        self._abort_since: int | None = None
        """Operations on tags from here on fail (see `abort_reaches`)."""
        self._derived: dict[int, tuple[ThreadFabric, set[int]]] = {}
        """Fabrics being handed out by `derived`, with the ranks that have taken theirs."""
        self._meetings: dict[tuple[str, int], dict[int, tuple[np.ndarray, LockRequest, Receive]]] = {}
        """Engine calls under way, by (what, tag): each arrived rank's contribution, request and
        receive function."""
        self._abandoned: dict[tuple[str, int], set[int]] = {}
        """The ranks that had arrived at engine calls an abort or a close withdrew, so that a rank
        timing out at the same moment still names the rank that never came (`arrived`)."""

    def endpoint(self, rank: int) -> ThreadTransport:
        """The transport of one rank."""
        return ThreadTransport(self, rank)

    def post(
        self, kind: str, rank: int, peer: int, tag: int, buf: np.ndarray, header: bytes, consume: Consume | None = None
    ) -> LockRequest:
        """Post a send or receive; complete it at once if its partner is already waiting."""
        check_buffer(buf)
        if not 0 <= peer < self.size:
            raise ValueError(f"rank {rank}: peer {peer} is outside the world of size {self.size}")
        if is_device(buf):
            request: LockRequest = DeviceRequest(kind, rank, peer, tag, buf, header, consume)
        else:
            request = LockRequest(kind, rank, peer, tag, buf, header, consume)
        with self._lock:
            if self._abort is not None or self._closed:
                abort = self._abort if abort_reaches(tag, self._abort_since) else None
                failure = post_refusal(abort, self._closed, rank, peer)
                if failure is not None:
                    request._finish(failure)
                    return request
            if kind == _SEND:
                partner = self._matcher.match_message((rank, peer, tag), request)
            else:
                partner = self._matcher.match_receive((peer, rank, tag), request)
            if partner is None:
                return request
        send, recv = (request, partner) if kind == _SEND else (partner, request)
        _deliver(send, recv)
        return request

    def meet(self, what: str, rank: int, tag: int, contribution: np.ndarray, receive: Receive) -> LockRequest:
        """Join the engine call `what` of the collective at `tag` with `contribution`; the last
        rank to arrive hands every rank's `receive` the contributions of all (in rank order) and
        completes every rank's request: one hand-off per rank, where a dissemination takes
        log2(size) rounds of messages."""
        request = LockRequest(_RECV, rank, rank, tag, contribution, what.encode())
        with self._lock:
            if self._abort is not None or self._closed:
                abort = self._abort if abort_reaches(tag, self._abort_since) else None
                failure = post_refusal(abort, self._closed, rank, rank)
                if failure is not None:
                    request._finish(failure)
                    return request
            arrived = self._meetings.setdefault((what, tag), {})
            arrived[rank] = (contribution, request, receive)
            if len(arrived) < self.size:
                return request
            del self._meetings[what, tag]
        contributions = [arrived[r][0] for r in range(self.size)]
        for _, waiting, deliver in arrived.values():
            deliver(contributions)
            waiting._finish()
        return request

    def arrived(self, what: str, tag: int) -> set[int]:
        """The ranks waiting in the engine call `what` of the collective at `tag` (or that were
        waiting in it when an abort withdrew it)."""
        with self._lock:
            return set(self._meetings.get((what, tag), ())) | self._abandoned.get((what, tag), set())

    def _withdraw_meetings(self, reached: Callable[[LockRequest], bool]) -> list[LockRequest]:
        """Take the requests of unfinished engine calls that `reached` picks (lock held)."""
        withdrawn: list[LockRequest] = []
        for key, arrived in list(self._meetings.items()):
            requests = [request for _, request, _ in arrived.values()]
            if any(reached(request) for request in requests):
                del self._meetings[key]
                self._abandoned[key] = set(arrived)
                withdrawn.extend(requests)
        return withdrawn

    def abort(self, origin: int, error: BaseException, since_tag: int | None = None) -> None:
        """Fail every pending and future request of every rank on tags from `since_tag` on (all
        with None) with `error` from `origin`; the first abort's error is the one reported."""

        def reached(request: LockRequest) -> bool:
            return abort_reaches(request.tag, self._abort_since)

        with self._lock:
            if self._abort is None:
                self._abort = (origin, abort_kind(error), str(error))
                self._abort_since = since_tag
            else:
                self._abort_since = earlier_abort(self._abort_since, since_tag)
            receives, sends = self._matcher.withdraw(reached, reached)
            meetings = self._withdraw_meetings(reached)
            abort = self._abort
        for request in receives + sends + meetings:
            request._finish(error_from_abort(*abort, rank=request.rank))

    def derived(self, key: int, rank: int) -> ThreadFabric:
        """The fabric every rank gets for the same `key`: made by the first rank to ask, forgotten
        once every rank has taken it (so a key may be used again afterwards)."""
        with self._lock:
            fabric, takers = self._derived.setdefault(key, (ThreadFabric(self.hosts), set()))
            takers.add(rank)
            if len(takers) == self.size:
                del self._derived[key]
        return fabric

    def close(self, rank: int) -> None:
        """Close one rank's endpoint; requests that involve it fail instead of waiting forever."""

        def involved(request: LockRequest) -> bool:
            return rank in (request.rank, request.peer)

        with self._lock:
            self._closed.add(rank)
            receives, sends = self._matcher.withdraw(involved, involved)
            meetings = self._withdraw_meetings(lambda request: True)  # the closed rank will never join
        for request in receives + sends:
            who = "transport" if request.rank == rank else f"peer rank {rank}'s transport"
            request._finish(PeerLostError(f"rank {request.rank}: {who} closed with a {request.kind} pending"))
        for request in meetings:
            request._finish(PeerLostError(f"rank {request.rank}: rank {rank} closed its transport during a collective"))


class DeviceRequest(LockRequest):
    """A posted send or receive of a device buffer: also the point in the poster's stream that
    the copy must follow (the kernels that produced a send buffer, or still use a receive buffer)."""

    __slots__ = ("ready",)

    def __init__(
        self, kind: str, rank: int, peer: int, tag: int, buf: object, header: bytes, consume: Consume | None = None
    ) -> None:
        LockRequest.__init__(self, kind, rank, peer, tag, buf, header, consume)
        self.ready: Event = runtime().ready(buf)


def _deliver(send: LockRequest, recv: LockRequest) -> None:
    """Copy a matched message straight from the sender's buffer, or fail both sides saying what
    each had."""
    error = check(recv, send.header, send.nbytes)
    if error is not None:
        send._finish(MismatchError(*error.args))  # its own object: each rank's raise adds its own traceback
        recv._finish(error)
        return
    if type(send) is LockRequest and type(recv) is LockRequest:
        failure = receive_payload(recv, send.buf)
    else:
        failure = receive_payload(recv, send.buf, (_ready(send), _ready(recv)))
    send._finish()
    recv._finish(failure)


def _ready(request: LockRequest) -> Event:
    """The event a device request recorded when posted; None for a host one."""
    return request.ready if isinstance(request, DeviceRequest) else None


class ThreadTransport(Transport):
    """One rank's view of a `ThreadFabric`."""

    def __init__(self, fabric: ThreadFabric, rank: int) -> None:
        if not 0 <= rank < fabric.size:
            raise ValueError(f"rank {rank} is outside the world of size {fabric.size}")
        self.fabric = fabric
        self.rank = rank
        self.size = fabric.size
        self.host = fabric.hosts[rank]

    def isend(self, buf: np.ndarray, dst: int, tag: int, header: bytes) -> LockRequest:
        return self.fabric.post(_SEND, self.rank, dst, tag, buf, header)

    def irecv(self, buf: np.ndarray, src: int, tag: int, header: bytes) -> LockRequest:
        return self.fabric.post(_RECV, self.rank, src, tag, buf, header)

    fuses_receive_reduce = True

    def wait_any(self, requests: Sequence[LockRequest], timeout: float) -> None:  # type: ignore[override]
        """Block until one of `requests` completes: its completion wakes this thread, no polling."""
        wait_first(requests, timeout)

    def irecv_reduce(self, buf: np.ndarray, src: int, tag: int, header: bytes, consume: Consume) -> LockRequest:
        return self.fabric.post(_RECV, self.rank, src, tag, buf, header, consume)

    agrees_natively = True

    def start_agreement(self, digest: np.ndarray, result: np.ndarray, tag: int) -> LockRequest:
        def maximum(digests: list[np.ndarray]) -> None:
            np.maximum.reduce(digests, out=result)

        return self.fabric.meet(_AGREE, self.rank, tag, digest, maximum)

    def gather_headers(self, header: bytes, tag: int, timeout: float) -> list[bytes]:
        gathered: list[bytes] = []

        def keep(headers: list[np.ndarray]) -> None:
            gathered.extend(bytes(h) for h in headers)

        self.fabric.meet(_GATHER, self.rank, tag, np.frombuffer(header, np.uint8), keep).wait(timeout)
        return gathered

    def announce_waiting(self, tag: int) -> None:
        """Nothing to send: the fabric sees who waits (`waiting_ranks`)."""

    def waiting_ranks(self, tag: int) -> set[int]:
        return self.fabric.arrived(_AGREE, tag) - {self.rank}

    duplicable = True

    def dup(self, key: int) -> ThreadTransport:
        transport = self.fabric.derived(key, self.rank).endpoint(self.rank)
        transport.host = self.host
        return transport

    def abort(self, error: BaseException, since_tag: int | None = None) -> None:
        self.fabric.abort(self.rank, error, since_tag)

    def close(self) -> None:
        self.fabric.close(self.rank)


def node_hosts(world_size: int, ranks_per_node: int | Sequence[int] | None) -> list[str]:
    """Host names that place ranks on emulated nodes, in rank order.

    Args:
        world_size: number of ranks.
        ranks_per_node: None (one node), an int (equal nodes, the last may be smaller), or a
            list of node sizes summing to `world_size` (uneven nodes).
    """
    if ranks_per_node is None:
        sizes = [world_size]
    elif isinstance(ranks_per_node, int):
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        full, rest = divmod(world_size, ranks_per_node)
        sizes = [ranks_per_node] * full + ([rest] if rest else [])
    else:
        sizes = [int(s) for s in ranks_per_node]
        if any(s < 1 for s in sizes) or sum(sizes) != world_size:
            raise ValueError(
                f"ranks_per_node {list(ranks_per_node)} must be positive sizes summing to the world size {world_size}"
            )
    return [f"node{node}" for node, count in enumerate(sizes) for _ in range(count)]
