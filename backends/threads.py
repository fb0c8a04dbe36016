"""In-process transport: every rank is a thread, messages are real copies between buffers.

All ranks of one world share a `ThreadFabric`. A send and a receive are matched by (source,
destination, tag) in posting order, exactly like MPI (`matching.Matcher`, whose unexpected
messages are the senders' requests themselves), and whichever of the two is posted second
copies the payload straight from the sender's buffer into the receiver's (one copy, no staging, and
numpy releases the GIL while it copies, so ranks really run in parallel). Nothing is shared between
ranks except through messages, so an algorithm that is correct here is correct over MPI.

The fabric is also where failures propagate: `abort` wakes every pending request of every rank with
the error, and later posts fail at once, which is how `run_threads` guarantees no rank hangs after
another one raised.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from .base import Consume, LockRequest, Transport, check_buffer, wait_first
from .errors import MismatchError, PeerLostError, abort_kind, error_from_abort, post_refusal
from .matching import Matcher, check, receive_payload

_SEND = "send"
_RECV = "recv"


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
        request = LockRequest(kind, rank, peer, tag, buf, header, consume)
        with self._lock:
            if self._abort is not None or self._closed:
                failure = post_refusal(self._abort, self._closed, rank, peer)
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

    def abort(self, origin: int, error: BaseException) -> None:
        """Fail every pending and future request of every rank with `error` from `origin`."""
        with self._lock:
            if self._abort is None:
                self._abort = (origin, abort_kind(error), str(error))
            receives, sends = self._matcher.drain()
            abort = self._abort
        for request in receives + sends:
            request._finish(error_from_abort(*abort, rank=request.rank))

    def close(self, rank: int) -> None:
        """Close one rank's endpoint; requests that involve it fail instead of waiting forever."""

        def involved(request: LockRequest) -> bool:
            return rank in (request.rank, request.peer)

        with self._lock:
            self._closed.add(rank)
            receives, sends = self._matcher.withdraw(involved, involved)
        for request in receives + sends:
            who = "transport" if request.rank == rank else f"peer rank {rank}'s transport"
            request._finish(PeerLostError(f"rank {request.rank}: {who} closed with a {request.kind} pending"))


def _deliver(send: LockRequest, recv: LockRequest) -> None:
    """Copy a matched message straight from the sender's buffer, or fail both sides saying what
    each had."""
    error = check(recv, send.header, send.nbytes)
    if error is not None:
        send._finish(MismatchError(*error.args))  # its own object: each rank's raise adds its own traceback
        recv._finish(error)
        return
    failure = receive_payload(recv, send.buf)
    send._finish()
    recv._finish(failure)


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

    def abort(self, error: BaseException) -> None:
        self.fabric.abort(self.rank, error)

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
