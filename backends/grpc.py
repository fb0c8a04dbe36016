"""gRPC transport: every rank serves one gRPC server and keeps one channel per peer.

Each rank opens, to every peer, one long-lived client-streaming call (``Stream``) and pushes its
messages down it; the peer's server reads them in order. No protobuf: methods are registered with
generic handlers whose (de)serializers are the identity on bytes. The wire format
(`_grpc_config.decode_frame`) is one gRPC message per *frame*::

    prefix (24 bytes: magic, version, flags, tag, total size, header length) | header | payload

A message of n bytes is cut into frames of at most `chunk_bytes` of payload (1 MiB by default);
the first carries the collective's header and n. Frames are built straight from the caller's
numpy buffer (one copy, into the ``bytes`` object gRPC insists on), lazily, by the stream's
request iterator, so a queued send costs no memory.

Ordering and matching. One stream per (sender, receiver) pair gives MPI's non-overtaking order
for free. The receiver matches each arriving message to the oldest receive posted for its
(source, tag) (`matching.Matcher`); if there is none, the message is kept (as the frames gRPC
delivered, no copy) until one is posted. A matched message is copied into the receive buffer.
(`irecv_reduce`, which hands the message to the reduction straight from gRPC's bytes on the server
thread, is implemented, but `fuses_receive_reduce` stays False: alternating both in one run
measured no difference.) Headers are compared (`matching.check`) at match time, or for a receive
that took a message still arriving, once it has arrived: a different header, or a payload size
different from the receive buffer's, fails the receive with `MismatchError` (the sender learns
through the receiver's abort).

Backpressure. Unmatched data kept for one source is bounded (`max_unmatched_bytes`, 256 MiB by
default): beyond it the server stops reading that source's stream, HTTP/2 flow control stalls the
sender, and its sends simply stay queued. Head-of-line blocking is the price: a receive that waits
for a message queued *behind* more than that much unmatched data from the same source waits until
the collective's deadline. The library's algorithms never get near it.

Send completion. A send completes once its last frame has been copied out of the caller's
buffer (MPI's "buffer reusable" semantics); `close` then flushes the stream before returning.

Failure handling.
* `abort(error)` sends a small ``Abort`` call (origin, kind, text) to every peer, fire and forget
  with a short deadline; a rank receiving it fails every pending and future request with
  `error_from_abort`, and passes the notice on to the others (so it reaches everyone even if the
  origin dies, and always before this rank's streams end: `close` waits for the notices first,
  so peers learn the real cause rather than "rank r closed").
* A peer whose process dies breaks both streams with it at once (the kernel closes the sockets):
  the server sees its incoming stream cancelled, the client sees its outgoing call fail, and
  either marks the peer lost, failing every pending receive from it (the one whose message it cut
  off included) and every send to it with `PeerLostError` naming it. HTTP/2 keepalive (20 s)
  catches peers whose machine vanished.
* A peer closing cleanly ends its stream; receives it can no longer satisfy fail the same way.

Start-up. The constructor binds this rank's address (and only that one), then pings every peer
with exponentially growing attempts until `startup_timeout`, naming the ranks and addresses that
never answered. Pings also check that the peer is the rank the cluster says it is.

Security. With a shared secret (``COLLECTIVES_SECRET``) every call carries it as metadata and
every handler checks it with `hmac.compare_digest`; a call without it or with a wrong one is
refused with UNAUTHENTICATED and the server logs one warning per peer address. Without TLS the
secret travels in clear text: it keeps strangers and stale jobs out, not eavesdroppers. TLS is
enabled by certificate files (see `_grpc_config`). Garbage is refused with an error status and
never crashes the server: unknown methods (UNIMPLEMENTED), frames over the message size limit
(RESOURCE_EXHAUSTED), callers claiming an impossible rank or a rank that already has its stream
(INVALID_ARGUMENT / FAILED_PRECONDITION) and malformed frames (INVALID_ARGUMENT; nothing is
allocated from a claimed size, and the stream that carried them is dropped).

Performance (2 ranks on the 2-core development VM, ring, float32 sum; see
``tests/grpc_scripts/bench_grpc.py``): 0.6-0.7 GB/s busbw at 16 MiB, 0.7-0.8 at 64 MiB, about
1.2 ms for 4 KiB. Both processes are CPU-bound (about 0.8 core each): grpcio 1.85's Python layer
copies every message twice on the way out (our frame, then gRPC's slice) and three times on the
way in (slices to bytes, to a bytearray, to bytes), and each frame costs several thread hand-offs
(request iterator, channel spin thread, server poller, handler). None of that is reachable
through grpcio's public API: plain gRPC streams exchanging the same bytes with none of this
module's logic (``bench_grpc.py --raw``) measure the same at 16 MiB and about 20% more at 64 MiB.
"""

from __future__ import annotations

import atexit
import hmac
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from typing import Any, NoReturn

import numpy as np

from . import _grpc_config as wire
from .base import Consume, LockRequest, Transport, check_buffer, wait_first
from .errors import BackendUnavailableError, CollectiveError, PeerLostError, abort_kind, error_from_abort
from .matching import Matcher, check, receive_payload

log = logging.getLogger(__name__)

SERVICE = "collectives.Transport"
_STREAM_METHOD = f"/{SERVICE}/Stream"
_PING_METHOD = f"/{SERVICE}/Ping"
_ABORT_METHOD = f"/{SERVICE}/Abort"

SECRET_METADATA_KEY = "x-collectives-secret-bin"
RANK_METADATA_KEY = "x-collectives-rank"
SIZE_METADATA_KEY = "x-collectives-size"

DEFAULT_CHUNK_BYTES = 1024 * 1024
"""Payload bytes per frame: the algorithms' default segment, so a segment travels as one frame.
(512 KiB and 4 MiB measured within noise of it on 2 loopback ranks; 64 KiB was 3x slower.)"""

MAX_FRAME_PAYLOAD_BYTES = 16 * 1024 * 1024
"""Frames up to this payload are accepted from peers whatever this rank's own `chunk_bytes`;
larger ones are refused by gRPC (RESOURCE_EXHAUSTED) before any of this module sees them."""

DEFAULT_MAX_UNMATCHED_BYTES = 256 * 1024 * 1024
DEFAULT_STARTUP_TIMEOUT = 60.0
ABORT_DEADLINE = 2.0
"""Seconds an abort notice may take to reach a peer; it is fire and forget."""
MESSAGE_OVERHEAD_BYTES = 256
"""Charged per unmatched message on top of its payload, so that floods of empty messages are
bounded by `max_unmatched_bytes` too."""
CLOSE_FLUSH_SECONDS = 10.0
"""How long `close` waits for queued frames to reach the peers."""


_STREAM_ENDED = "is lost: its stream ended (it closed its transport, or its process exited or died)"
"""Why a peer is gone when its stream ended without an error: a killed process's can end so too."""


def _import_grpc() -> Any:
    try:
        import grpc
    except ImportError:
        raise BackendUnavailableError("grpc", "grpcio", "grpc") from None
    return grpc


def _close_before_exit(transport: GrpcTransport) -> None:
    """Close `transport` when the interpreter starts to exit, if the program did not.

    The server's handler threads wait on their peers' streams and the thread pool joins them at
    exit, so a program that exits without `close()` (after an uncaught exception, say) would wait
    for its peers forever, and they for it. Closing must therefore run before threads are joined:
    plain `atexit` handlers run after that, so this uses the hook concurrent.futures itself uses
    (`threading._register_atexit`), where it exists.
    """
    reference = weakref.ref(transport)

    def close() -> None:
        alive = reference()
        if alive is not None:
            alive.close()

    register = getattr(threading, "_register_atexit", None)
    try:
        (register or atexit.register)(close)
    except RuntimeError:  # the interpreter is already shutting down
        pass


def _identity(data: bytes) -> bytes:
    return data


# -- requests ----------------------------------------------------------------------------------------


_CLAIMS = threading.Lock()
"""Makes claiming a request atomic: checking that it is unfinished and finishing it."""


class _Request(LockRequest):
    """A posted send or receive. Several threads may race to complete one (a frame arriving, an
    abort, a close), so completing first claims it: the first outcome wins."""

    __slots__ = ()

    @property
    def finished(self) -> bool:
        return self.buf is None  # dropped on completion, never before

    def _finish(self, error: CollectiveError | None = None) -> None:
        """Complete the request, unless it was already completed (the first outcome wins)."""
        with _CLAIMS:
            if self.buf is not None:
                super()._finish(error)


class _Incoming:
    """A message that arrived (or is arriving) before its receive was posted."""

    __slots__ = ("src", "tag", "header", "total", "parts", "received", "complete", "recv")

    def __init__(self, src: int, tag: int, header: bytes, total: int) -> None:
        self.src = src
        self.tag = tag
        self.header = header
        self.total = total
        self.parts: list[memoryview] = []
        self.received = 0
        self.complete = False
        self.recv: _Request | None = None  # a receive posted while the message was still arriving


class _Landing:
    """Where the rest of a multi-frame message goes once its first frame was handled: into the
    receive it was matched to (`recv`), into a message held for a receive not yet posted
    (`incoming`), or, with neither, nowhere (a message nobody will get: mismatch, abort)."""

    __slots__ = ("tag", "total", "recv", "incoming", "offset", "parts")

    def __init__(self, tag: int, total: int, recv: _Request | None = None, incoming: _Incoming | None = None) -> None:
        self.tag = tag
        self.total = total
        self.recv = recv
        self.incoming = incoming
        self.offset = 0
        self.parts: list[memoryview] = []  # the frames, for a receive that hands them to `consume`

    def receive(self) -> _Request | None:
        """The receive this message is for, if one is waiting for the rest of it: the one it was
        matched to on arrival, or one that took it while it was still arriving. Lock held."""
        if self.recv is not None:
            return self.recv
        return None if self.incoming is None else self.incoming.recv


def _frame(head: bytes, data: np.ndarray) -> bytes:
    """`head + data` as one new bytes object (the type gRPC requires): the one copy of a send.

    (Filling a fresh bytes object with a GIL-releasing memmove instead measured no faster.)
    """
    return b"".join((head, data.data))


def _payload(parts: list[memoryview]) -> memoryview | bytes:
    if len(parts) == 1:
        return parts[0]
    return b"".join(parts)


# -- the transport --------------------------------------------------------------------------------


class GrpcTransport(Transport):
    """One rank's endpoint of a gRPC world.

    Args:
        rank: this rank.
        addresses: "host:port" of every rank, in rank order; this rank's server binds its own.
        host: node identity (see `_grpc_config`); default derived from this rank's address.
        secret: shared secret every call must carry, or None to accept unauthenticated calls.
        tls: certificate files for TLS, or None for plain text.
        startup_timeout: seconds to wait for every peer to answer before giving up.
        chunk_bytes: payload bytes per gRPC message.
        max_unmatched_bytes: per source, data kept for receives not yet posted before the server
            stops reading from that source (backpressure).

    Raises:
        BackendUnavailableError: grpcio is not installed.
        ValueError: bad arguments.
        OSError: this rank's address cannot be bound.
        PeerLostError: some peers did not answer within `startup_timeout` (names them).
    """

    fuses_receive_reduce = False

    def __init__(
        self,
        rank: int,
        addresses: tuple[str, ...] | list[str],
        *,
        host: str | None = None,
        secret: bytes | str | None = None,
        tls: wire.TlsFiles | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_unmatched_bytes: int = DEFAULT_MAX_UNMATCHED_BYTES,
    ) -> None:
        grpc = _import_grpc()
        self._grpc = grpc
        addresses = tuple(addresses)
        if not addresses:
            raise ValueError("addresses must list at least one rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(addresses):
            raise ValueError(f"rank must be in 0..{len(addresses) - 1}, got {rank!r}")
        for index, address in enumerate(addresses):
            wire.split_address(address, what=f"address of rank {index}")
        if not 1 <= chunk_bytes <= MAX_FRAME_PAYLOAD_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_FRAME_PAYLOAD_BYTES}, got {chunk_bytes}")
        if not startup_timeout > 0:
            raise ValueError(f"startup_timeout must be a positive number of seconds, got {startup_timeout!r}")
        self.rank = rank
        self.size = len(addresses)
        self.addresses = addresses
        self.host = host if host is not None else wire.node_name(addresses[rank])
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self._tls = tls
        self._chunk_bytes = int(chunk_bytes)
        self._max_unmatched = int(max_unmatched_bytes)

        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)  # signalled when unmatched bytes shrink
        self._matcher: Matcher[tuple[int, int], _Request, _Incoming] = Matcher()
        """Keyed by (source, tag): receives posted here, messages from peers that came before them."""
        self._unmatched_bytes = [0] * self.size
        self._landing: dict[int, _Landing] = {}  # per source: receives being filled frame by frame
        self._lost: dict[int, CollectiveError] = {}
        self._abort: tuple[int, str, str] | None = None
        self._closed = False
        self._streams_in: set[int] = set()
        self._warned_peers: set[str] = set()
        self._abort_calls: list[Any] = []

        frame_limit = self._chunk_bytes + wire.PREFIX.size + wire.MAX_HEADER_BYTES
        # Accept peers configured with larger frames (up to 16 MiB); refuse anything bigger.
        receive_limit = max(frame_limit, MAX_FRAME_PAYLOAD_BYTES + wire.PREFIX.size + wire.MAX_HEADER_BYTES)
        self._options: list[tuple[str, int | str]] = [
            ("grpc.max_send_message_length", frame_limit),
            ("grpc.max_receive_message_length", receive_limit),
            ("grpc.enable_retries", 0),  # retries would keep a copy of every frame
            ("grpc.so_reuseport", 0),  # a port in use must fail, not be shared
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self._server: Any | None = None  # a grpc.Server once started
        self._channels: dict[int, Any] = {}
        self._outboxes: dict[int, queue.SimpleQueue] = {}
        self._stream_calls: dict[int, Any] = {}
        try:
            self._start_server()
            self._connect(float(startup_timeout))
        except BaseException:
            self._shutdown_quietly()
            raise
        _close_before_exit(self)

    @classmethod
    def from_environment(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        **options: Any,
    ) -> GrpcTransport:
        """Join the world described by the environment (COLLECTIVES_* or TF_CONFIG).

        See `collectives.backends._grpc_config` for the variables. ``COLLECTIVES_GRPC_CHUNK_BYTES`` optionally
        overrides `chunk_bytes`; other keyword arguments go to the constructor.

        Raises:
            ValueError: a variable is missing or malformed (the message names it).
        """
        _import_grpc()
        config = wire.load_config(environ)
        env = os.environ if environ is None else environ
        chunk_text = env.get("COLLECTIVES_GRPC_CHUNK_BYTES")
        if "chunk_bytes" not in options and chunk_text:
            if not chunk_text.strip().isdigit() or not 1 <= int(chunk_text) <= MAX_FRAME_PAYLOAD_BYTES:
                raise ValueError(
                    f"COLLECTIVES_GRPC_CHUNK_BYTES must be an integer in 1..{MAX_FRAME_PAYLOAD_BYTES}, "
                    f"got {chunk_text!r}"
                )
            options["chunk_bytes"] = int(chunk_text)
        return cls(
            config.rank,
            config.addresses,
            host=config.host,
            secret=config.secret,
            tls=config.tls,
            startup_timeout=startup_timeout,
            **options,
        )

    # -- set-up -------------------------------------------------------------------------------------

    def _metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        items: list[tuple[str, str | bytes]] = [
            (RANK_METADATA_KEY, str(self.rank)),
            (SIZE_METADATA_KEY, str(self.size)),
        ]
        if self._secret is not None:
            items.append((SECRET_METADATA_KEY, self._secret))
        return tuple(items)

    def _start_server(self) -> None:
        grpc = self._grpc
        handlers = {
            "Stream": grpc.stream_unary_rpc_method_handler(self._serve_stream, _identity, _identity),
            "Ping": grpc.unary_unary_rpc_method_handler(self._serve_ping, _identity, _identity),
            "Abort": grpc.unary_unary_rpc_method_handler(self._serve_abort, _identity, _identity),
        }
        generic = grpc.method_handlers_generic_handler(SERVICE, handlers)
        # One thread per incoming peer stream, plus room for pings, aborts and refused callers.
        pool = futures.ThreadPoolExecutor(max_workers=self.size + 8, thread_name_prefix=f"collectives-grpc{self.rank}")
        self._pool = pool
        self._server = grpc.server(pool, handlers=[generic], options=self._options)
        address = self.addresses[self.rank]
        try:
            if self._tls is not None:
                credentials = grpc.ssl_server_credentials(
                    [(self._tls.private_key, self._tls.certificate)],
                    root_certificates=self._tls.ca,
                    require_client_auth=self._tls.ca is not None,
                )
                port = self._server.add_secure_port(address, credentials)
            else:
                port = self._server.add_insecure_port(address)
        except RuntimeError as error:
            raise OSError(f"rank {self.rank}: cannot listen on {address}: {error}") from None
        if not port:
            raise OSError(f"rank {self.rank}: cannot listen on {address} (address in use or not local)")
        self._server.start()

    def _channel(self, peer: int) -> Any:
        grpc = self._grpc
        target = self.addresses[peer]
        host, port = wire.split_address(target, what=f"address of rank {peer}")
        if host in ("0.0.0.0", "::"):  # a wildcard listener is reached through loopback
            target = f"127.0.0.1:{port}" if host == "0.0.0.0" else f"[::1]:{port}"
        options = list(self._options)
        if self._tls is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=self._tls.ca,
                private_key=self._tls.private_key,
                certificate_chain=self._tls.certificate,
            )
            if self._tls.server_name:
                options.append(("grpc.ssl_target_name_override", self._tls.server_name))
            return grpc.secure_channel(target, credentials, options=options)
        return grpc.insecure_channel(target, options=options)

    def _connect(self, startup_timeout: float) -> None:
        """Ping every peer until it answers (backoff up to `startup_timeout`), then open streams."""
        grpc = self._grpc
        deadline = time.monotonic() + startup_timeout
        peers = [peer for peer in range(self.size) if peer != self.rank]
        for peer in peers:
            self._channels[peer] = self._channel(peer)
        request = json.dumps({"rank": self.rank, "size": self.size}).encode()
        waiting = set(peers)
        failures: dict[int, str] = {}
        attempt = 0.1
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            calls = {}
            for peer in waiting:
                ping = self._channels[peer].unary_unary(
                    _PING_METHOD, request_serializer=_identity, response_deserializer=_identity
                )
                calls[peer] = ping.future(
                    request, timeout=min(attempt, remaining), metadata=self._metadata(), wait_for_ready=True
                )
            for peer, call in calls.items():
                try:
                    answer = json.loads(call.result())
                except grpc.RpcError as error:
                    code = error.code()
                    if code in (
                        grpc.StatusCode.UNAUTHENTICATED,
                        grpc.StatusCode.FAILED_PRECONDITION,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.UNIMPLEMENTED,
                    ):
                        raise PeerLostError(
                            f"rank {self.rank}: rank {peer} at {self.addresses[peer]} refused to join: "
                            f"{code.name}: {error.details()}"
                        ) from None
                    failures[peer] = f"{code.name}: {error.details()}"
                    continue
                except ValueError:
                    failures[peer] = "answered with garbage"
                    continue
                if answer.get("rank") != peer or answer.get("size") != self.size:
                    raise PeerLostError(
                        f"rank {self.rank}: {self.addresses[peer]} answers as rank {answer.get('rank')} of "
                        f"{answer.get('size')}, but the cluster lists it as rank {peer} of {self.size}"
                    )
                waiting.discard(peer)
            attempt = min(attempt * 2, 5.0)
        if waiting:
            names = ", ".join(
                f"rank {peer} at {self.addresses[peer]} ({failures.get(peer, 'no answer')})" for peer in sorted(waiting)
            )
            raise PeerLostError(
                f"rank {self.rank}: peers did not answer within the start-up timeout of {startup_timeout:g} s: {names}"
            )
        for peer in peers:
            self._open_stream(peer)

    def _open_stream(self, peer: int) -> None:
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outboxes[peer] = outbox
        stream = self._channels[peer].stream_unary(
            _STREAM_METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        # Not wait_for_ready: the peer just answered a ping, and if it died since, the call must
        # fail (marking it lost) rather than wait for it forever.
        call = stream.future(self._frames(peer, outbox), metadata=self._metadata(), wait_for_ready=False)
        self._stream_calls[peer] = call
        call.add_done_callback(lambda done, peer=peer: self._stream_ended(peer, done))

    # -- sending ------------------------------------------------------------------------------------

    def isend(self, buf: np.ndarray, dst: int, tag: int, header: bytes) -> _Request:
        self._check(buf, dst, tag, header)
        request = _Request("send", self.rank, dst, tag, buf, header)
        with self._lock:
            refusal = self._refusal(dst)
        if refusal is not None:
            request._finish(refusal)
            return request
        if dst == self.rank:
            self._arrive_whole(self.rank, tag, header, buf.nbytes, memoryview(buf.tobytes()))
            request._finish()
            return request
        outbox = self._outboxes[dst]
        outbox.put(request)
        if dst in self._lost or self._abort is not None:  # raced with a failure that drained the queue
            self._fail_queue(outbox, self._refusal(dst) or PeerLostError(f"rank {self.rank}: peer rank {dst} is gone"))
        return request

    def _frames(self, peer: int, outbox: queue.SimpleQueue) -> Iterator[bytes]:
        """The request iterator of the stream to `peer`: frames of each queued send, in order."""
        chunk = self._chunk_bytes
        while True:
            request = outbox.get()
            if request is None:
                return
            if request.finished:  # failed by an abort or a lost peer while queued
                continue
            header, buf = request.header, request.buf
            if buf is None:
                continue
            data = buf.view(np.uint8)
            total = data.nbytes
            if total <= chunk:
                frame = _frame(
                    wire.encode_prefix(wire.FLAG_FIRST | wire.FLAG_LAST, request.tag, total, len(header)) + header, data
                )
                request._finish()
                yield frame
                continue
            for start in range(0, total, chunk):
                stop = min(start + chunk, total)
                flags = (wire.FLAG_FIRST if start == 0 else 0) | (wire.FLAG_LAST if stop == total else 0)
                first_header = header if start == 0 else b""
                frame = _frame(
                    wire.encode_prefix(flags, request.tag, total, len(first_header)) + first_header, data[start:stop]
                )
                if stop == total:
                    request._finish()
                yield frame

    def _stream_ended(self, peer: int, call: Any) -> None:
        """The outgoing stream to `peer` finished: fine while closing, a lost peer otherwise."""
        if self._closed:
            return
        try:
            call.result()
            reason = _STREAM_ENDED
        except self._grpc.RpcError as error:
            code = error.code()
            reason = f"is unreachable ({code.name if code else 'unknown'}: {error.details()})"
        except BaseException as error:  # noqa: BLE001 - cancelled or failed: the peer is gone
            reason = f"is unreachable ({error!r})"
        self._peer_gone(peer, f"rank {self.rank}: peer rank {peer} at {self.addresses[peer]} {reason}")

    # -- receiving ----------------------------------------------------------------------------------

    def irecv(self, buf: np.ndarray, src: int, tag: int, header: bytes) -> _Request:
        return self._post_recv(buf, src, tag, header, None)

    # A transport is only ever given its own requests to wait for, which the base signature cannot say.
    def wait_any(self, requests: Sequence[_Request], timeout: float) -> None:  # type: ignore[override]
        """Block until one of `requests` completes: the thread completing it wakes this one, so a
        rank driving several streams sleeps until there is work instead of polling the cores its
        own stream threads need."""
        wait_first(requests, timeout)

    def irecv_reduce(self, buf: np.ndarray, src: int, tag: int, header: bytes, consume: Consume) -> _Request:
        return self._post_recv(buf, src, tag, header, consume)

    def _post_recv(self, buf: np.ndarray, src: int, tag: int, header: bytes, consume: Consume | None) -> _Request:
        self._check(buf, src, tag, header)
        if consume is None and not buf.flags.writeable:
            raise ValueError("receive buffers must be writeable")
        request = _Request("recv", self.rank, src, tag, buf, header, consume)
        incoming = None
        with self._lock:
            if self._abort is not None or self._closed:
                refusal = self._refusal(src)
            else:
                incoming = self._matcher.take_message((src, tag))
                # A lost sender sends nothing more: only what it finished sending can be received.
                refusal = None if incoming is not None and incoming.complete else self._lost.get(src)
                if refusal is None:
                    if incoming is None:
                        self._matcher.post_receive((src, tag), request)
                        return request
                    if not incoming.complete:
                        incoming.recv = request  # the arriving frames will complete it
                        return request
                    self._unmatched_bytes[src] -= incoming.total + MESSAGE_OVERHEAD_BYTES
                    self._space.notify_all()
        if refusal is not None:
            request._finish(refusal)
        elif incoming is not None:  # a whole message it could take at once
            self._deliver(request, incoming.header, incoming.total, _payload(incoming.parts))
        return request

    def _check(self, buf: np.ndarray, peer: int, tag: int, header: bytes) -> None:
        check_buffer(buf)
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"the grpc backend moves numpy arrays, got {type(buf).__name__}")
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: peer {peer!r} is outside the world of size {self.size}")
        if not 0 <= tag < wire.MAX_TAG:
            raise ValueError(f"tag must be in 0..{wire.MAX_TAG - 1}, got {tag}")
        if not isinstance(header, bytes) or len(header) > wire.MAX_HEADER_BYTES:
            raise ValueError(f"header must be bytes of at most {wire.MAX_HEADER_BYTES} bytes")

    def _deliver(self, request: _Request, header: bytes, total: int, payload: memoryview | bytes) -> None:
        """Complete a receive with a whole message (checked here)."""
        buf = request.buf
        if buf is None:  # failed meanwhile (abort, close)
            return
        error = check(request, header, total) or receive_payload(request, np.frombuffer(payload, dtype=buf.dtype))
        request._finish(error)

    def _hold(self, src: int, tag: int, header: bytes, total: int) -> _Incoming:
        """Keep a message no receive was posted for, counting it against `src`'s limit. Lock held."""
        incoming = _Incoming(src, tag, header, total)
        self._matcher.hold_message((src, tag), incoming)
        self._unmatched_bytes[src] += total + MESSAGE_OVERHEAD_BYTES
        return incoming

    def _arrive_whole(self, src: int, tag: int, header: bytes, total: int, data: memoryview) -> None:
        """A message that came in one frame (or was sent to this rank itself)."""
        with self._lock:
            if self._abort is not None or self._closed:
                return
            recv = self._matcher.take_receive((src, tag))
            if recv is None:
                incoming = self._hold(src, tag, header, total)
                incoming.parts, incoming.received, incoming.complete = [data], total, True
                return
        self._deliver(recv, header, total, data)

    def _on_frame(self, src: int, frame: bytes) -> None:
        """Handle one frame of the stream from `src` (raises FrameError if it is malformed)."""
        flags, tag, total, header, data = wire.decode_frame(frame)
        landing = self._landing.get(src)
        if flags & wire.FLAG_FIRST:
            if landing is not None:
                raise wire.FrameError("a message started before the previous one ended")
            if flags & wire.FLAG_LAST and len(data) != total:
                raise wire.FrameError(f"single-frame message carries {len(data)} of its {total} bytes")
            self._wait_for_space(src, tag, total + MESSAGE_OVERHEAD_BYTES)
            if flags & wire.FLAG_LAST:
                self._arrive_whole(src, tag, header, total, data)
            else:
                self._begin(src, tag, header, total, data)
            return
        if landing is None:
            raise wire.FrameError("continuation frame without a message in progress")
        self._continue(src, landing, flags, tag, total, data)

    def _wait_for_space(self, src: int, tag: int, incoming_bytes: int) -> None:
        """Backpressure: stop reading from `src` while too much of its data waits unmatched
        (unless this message has a receive waiting for it)."""
        if self._unmatched_bytes[src] + incoming_bytes <= self._max_unmatched:
            return
        with self._lock:
            while (
                self._unmatched_bytes[src] > 0
                and self._unmatched_bytes[src] + incoming_bytes > self._max_unmatched
                and not self._matcher.has_receive((src, tag))
                and self._abort is None
                and not self._closed
                and src not in self._lost
            ):
                self._space.wait(1.0)

    def _begin(self, src: int, tag: int, header: bytes, total: int, data: memoryview) -> None:
        """First frame of a multi-frame message."""
        with self._lock:
            if self._abort is not None or self._closed:
                landing = _Landing(tag, total)
            else:
                recv = self._matcher.take_receive((src, tag))
                if recv is None:
                    landing = _Landing(tag, total, incoming=self._hold(src, tag, header, total))
                else:
                    error = check(recv, header, total)
                    if error is not None:
                        recv._finish(error)
                        landing = _Landing(tag, total)
                    else:
                        landing = _Landing(tag, total, recv=recv)
            self._landing[src] = landing
        self._land(landing, data)

    def _land(self, landing: _Landing, data: memoryview) -> None:
        recv, incoming = landing.recv, landing.incoming
        if incoming is not None:
            incoming.parts.append(data)
            incoming.received += len(data)
        elif recv is not None:
            if recv.consume is not None:
                landing.parts.append(data)
            else:
                buf = recv.buf
                if buf is not None and len(data):
                    target = buf.view(np.uint8)[landing.offset : landing.offset + len(data)]
                    np.copyto(target, np.frombuffer(data, dtype=np.uint8))
        landing.offset += len(data)

    def _continue(self, src: int, landing: _Landing, flags: int, tag: int, total: int, data: memoryview) -> None:
        if tag != landing.tag or total != landing.total:
            raise wire.FrameError("continuation frame of another message")
        received = landing.offset + len(data)
        if received > total or (flags & wire.FLAG_LAST and received != total):
            raise wire.FrameError(f"message frames add up to {received} bytes, not {total}")
        self._land(landing, data)
        if not flags & wire.FLAG_LAST:
            return
        with self._lock:
            del self._landing[src]
        recv, incoming = landing.recv, landing.incoming
        if recv is not None:
            if recv.consume is not None:
                self._deliver(recv, recv.header, total, _payload(landing.parts))
            else:
                recv._finish()
            return
        if incoming is None:  # skipped
            return
        with self._lock:
            incoming.complete = True
            taker = incoming.recv
            if taker is not None:
                self._unmatched_bytes[src] -= total + MESSAGE_OVERHEAD_BYTES
                self._space.notify_all()
        if taker is not None:
            self._deliver(taker, incoming.header, total, _payload(incoming.parts))

    # -- server handlers ----------------------------------------------------------------------------

    def _refuse(self, context: Any, code: Any, details: str) -> NoReturn:
        """End the call being served with the status `code` (a `grpc.StatusCode`)."""
        context.abort(code, details)  # raises, ending the handler
        raise RuntimeError(f"rank {self.rank}: grpc's ServicerContext.abort returned instead of ending the call")

    def _caller(self, context: Any) -> int:
        """The rank making the call being served. Refuses the call unless it carries the shared
        secret (UNAUTHENTICATED) and claims to be a peer in a world of this size (INVALID_ARGUMENT)."""
        metadata = dict(context.invocation_metadata() or ())
        if self._secret is not None:
            offered = metadata.get(SECRET_METADATA_KEY, b"")
            offered_bytes = offered.encode() if isinstance(offered, str) else bytes(offered)
            if not hmac.compare_digest(offered_bytes, self._secret):
                peer = context.peer()
                if peer not in self._warned_peers and len(self._warned_peers) < 1000:
                    self._warned_peers.add(peer)
                    log.warning(
                        "rank %d: refused a call from %s without the right shared secret "
                        "(COLLECTIVES_SECRET); is a stale or foreign job talking to this port?",
                        self.rank,
                        peer,
                    )
                self._refuse(context, self._grpc.StatusCode.UNAUTHENTICATED, "missing or wrong shared secret")
        invalid = self._grpc.StatusCode.INVALID_ARGUMENT
        text = metadata.get(RANK_METADATA_KEY)
        size_text = metadata.get(SIZE_METADATA_KEY)
        if text is None or size_text is None:
            self._refuse(context, invalid, "missing rank/size metadata")
        try:
            src, size = int(text), int(size_text)
        except ValueError:
            self._refuse(context, invalid, f"bad rank/size metadata {text!r}/{size_text!r}")
        if size != self.size:
            self._refuse(
                context, invalid, f"caller is in a world of {size} ranks, this rank {self.rank} in one of {self.size}"
            )
        if not 0 <= src < self.size or src == self.rank:
            self._refuse(
                context,
                invalid,
                f"caller claims to be rank {src}, not a peer of rank {self.rank} in a world of {self.size}",
            )
        return src

    def _serve_ping(self, request: bytes, context: Any) -> bytes:
        self._caller(context)  # refuses strangers
        return json.dumps({"rank": self.rank, "size": self.size}).encode()

    def _serve_abort(self, request: bytes, context: Any) -> bytes:
        src = self._caller(context)
        try:
            notice = json.loads(request)
            origin, kind, text = notice["origin"], notice["kind"], notice["text"]
            if not (
                isinstance(origin, int)
                and 0 <= origin < self.size
                and kind in ("mismatch", "lost")
                and isinstance(text, str)
            ):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            self._refuse(context, self._grpc.StatusCode.INVALID_ARGUMENT, "malformed abort notice")
        # Passed on to the other peers (not back to the origin or the sender).
        self._aborted((origin, kind, text[: wire.MAX_HEADER_BYTES]), skip={origin, src})
        return b""

    def _serve_stream(self, frames: Iterator[bytes], context: Any) -> bytes:
        grpc = self._grpc
        src = self._caller(context)
        refusal = None
        with self._lock:
            if src in self._streams_in:
                refusal = f"rank {src} already has a stream open to rank {self.rank}"
            elif self._closed:
                refusal = f"rank {self.rank} is closing"
            else:
                self._streams_in.add(src)
        if refusal is not None:
            self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, refusal)
        clean = False
        reason = "is unreachable (its stream to this rank broke)"
        try:
            for frame in frames:
                self._on_frame(src, frame)
            clean = True
            return b""
        except wire.FrameError as error:
            reason = f"sent a malformed frame ({error})"
            log.warning(
                "rank %d: refused a malformed frame from %s claiming rank %d: %s", self.rank, context.peer(), src, error
            )
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed frame: {error}")
        except grpc.RpcError:
            raise  # the peer's connection broke: reported as lost below
        except Exception as error:  # noqa: BLE001 - a bug here must not pass silently
            reason = f"could not be served ({error!r})"
            log.exception("rank %d: failed while receiving from rank %d", self.rank, src)
            self._refuse(context, grpc.StatusCode.INTERNAL, f"rank {self.rank} failed: {error!r}")
        finally:
            cut_off = None
            with self._lock:
                landing = self._landing.pop(src, None)
                self._streams_in.discard(src)
                if landing is not None:
                    cut_off = landing.receive()
                    held = landing.incoming
                    if held is not None:  # no receive may take it any more
                        self._matcher.withdraw(messages=lambda incoming: incoming is held)
            if cut_off is not None:
                cut_off._finish(
                    PeerLostError(f"rank {self.rank}: the message from rank {src} (tag {cut_off.tag}) was cut off")
                )
            if not self._closed:
                self._peer_gone(
                    src,
                    f"rank {self.rank}: peer rank {src} at {self.addresses[src]} "
                    + (_STREAM_ENDED if clean else reason),
                )

    # -- failures -----------------------------------------------------------------------------------

    def _refusal(self, peer: int) -> CollectiveError | None:
        """Why a new request with `peer` must fail at once, or None. Lock held."""
        if self._abort is not None:
            return error_from_abort(*self._abort, rank=self.rank)
        if self._closed:
            return PeerLostError(f"rank {self.rank}: transport already closed")
        return self._lost.get(peer)

    def _peer_gone(self, peer: int, text: str) -> None:
        """Fail what can no longer complete because `peer` left; keep what it already sent."""
        error = PeerLostError(text)
        with self._lock:
            if peer in self._lost:
                return
            self._lost[peer] = error
            # What it finished sending stays receivable; the message it was sending never completes.
            victims, _ = self._matcher.withdraw(
                lambda recv: recv.peer == peer, lambda incoming: incoming.src == peer and not incoming.complete
            )
            self._space.notify_all()
        log.debug("%s", text)
        for request in victims:
            request._finish(error)
        outbox = self._outboxes.get(peer)
        if outbox is not None:
            self._fail_queue(outbox, error)

    def _fail_queue(self, outbox: queue.SimpleQueue, error: CollectiveError) -> None:
        drained = []
        while True:
            try:
                drained.append(outbox.get_nowait())
            except queue.Empty:
                break
        for request in drained:
            if request is None:
                outbox.put(None)
            else:
                request._finish(error)

    def _aborted(self, abort: tuple[int, str, str], skip: set[int]) -> None:
        """Enter the aborted state (unless already in it): tell the peers not in `skip`, then
        fail everything pending. In that order, so that once a caller sees its request fail,
        `close` finds the notices it must wait for before ending this rank's streams."""
        with self._lock:
            if self._abort is not None:
                return
            self._abort = abort
            victims = self._withdraw_receives()
            self._unmatched_bytes = [0] * self.size
        self._broadcast_abort(abort, skip)
        for request in victims:
            request._finish(error_from_abort(*abort, rank=self.rank))
        for outbox in self._outboxes.values():
            self._fail_queue(outbox, error_from_abort(*abort, rank=self.rank))

    def _withdraw_receives(self) -> list[_Request]:
        """Forget every waiting receive and held message (the transport failed or closes); returns
        the receives, to be failed, including those being filled frame by frame. Lock held."""
        victims, _ = self._matcher.drain()
        for landing in self._landing.values():
            receive = landing.receive()
            if receive is not None:
                victims.append(receive)
        self._space.notify_all()
        return victims

    def abort(self, error: BaseException, since_tag: int | None = None) -> None:  # fails everything: no since_tag
        self._aborted((self.rank, abort_kind(error), str(error)), skip=set())

    def _broadcast_abort(self, notice: tuple[int, str, str], skip: set[int]) -> None:
        """Send an abort notice to every other peer: fire and forget (`close` waits for them)."""
        grpc = self._grpc
        body = json.dumps({"origin": notice[0], "kind": notice[1], "text": notice[2]}).encode()
        for peer, channel in self._channels.items():
            if peer in skip or peer in self._lost:
                continue
            try:
                call = channel.unary_unary(_ABORT_METHOD, request_serializer=_identity, response_deserializer=_identity)
                self._abort_calls.append(call.future(body, timeout=ABORT_DEADLINE, metadata=self._metadata()))
            except (grpc.RpcError, ValueError, RuntimeError):  # channel already closed
                pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            victims = self._withdraw_receives()
        for request in victims:
            request._finish(PeerLostError(f"rank {self.rank}: transport closed with a {request.kind} pending"))
        for call in self._abort_calls:  # let abort notices overtake the end of our streams
            try:
                call.result(timeout=ABORT_DEADLINE)
            except BaseException:  # noqa: BLE001 - fire and forget: a gone peer is fine
                pass
        for outbox in self._outboxes.values():
            outbox.put(None)  # ends the stream after the frames already queued
        deadline = time.monotonic() + CLOSE_FLUSH_SECONDS
        flush = (
            []
            if self._abort is not None
            else [  # after an abort the data is of no use
                call for peer, call in self._stream_calls.items() if peer not in self._lost
            ]
        )
        for call in flush:
            try:
                call.result(timeout=max(deadline - time.monotonic(), 0.0))
            except BaseException:  # noqa: BLE001 - the peer may be gone already; nothing to flush
                pass
        closing = PeerLostError(f"rank {self.rank}: transport closed with a send pending")
        for outbox in self._outboxes.values():
            self._fail_queue(outbox, closing)
        self._shutdown_quietly()

    def _shutdown_quietly(self) -> None:
        self._closed = True
        for channel in self._channels.values():
            try:
                channel.close()
            except Exception:  # noqa: BLE001
                pass
        if self._server is not None:
            self._server.stop(grace=0.25).wait(5.0)
            self._pool.shutdown(wait=False)

    def __repr__(self) -> str:
        return (
            f"GrpcTransport(rank={self.rank}, size={self.size}, "
            f"address={self.addresses[self.rank]!r}, host={self.host!r})"
        )
