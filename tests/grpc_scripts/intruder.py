"""Talk to a rank's gRPC server the way an attacker would, for the security tests.

* `send_frames`: an insider holding the secret authenticates as some rank and pushes frames it
  crafted down its stream;
* `FakeRank`: a server that answers the handshake as a listed rank (it holds the secret), so that
  the real ranks accept it, and drains whatever they send;
* `Squatter`: a server on a rank's port without the secret that records everything callers send
  it (method, metadata, body) and answers garbage.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from concurrent import futures
from typing import Any

import grpc

from collectives.backends import _grpc_config as wire
from collectives.backends import grpc as transport

HELLO = f"/{transport.SERVICE}/Hello"
STREAM = f"/{transport.SERVICE}/Stream"
ABORT = f"/{transport.SERVICE}/Abort"
BIG_MESSAGES = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    # a connection of its own: channels alike share one, and the calls of intruders sent one
    # after another then met a rank's limit of concurrent calls per connection (REFUSED_STREAM)
    ("grpc.use_local_subchannel_pool", 1),
]


def identity(data: bytes) -> bytes:
    return data


def frame(tag: int, sequence: int, payload: bytes = b"", header: bytes = b"", *, total: int | None = None) -> bytes:
    """One whole message as a single frame (`total` may claim another size)."""
    size = len(payload) if total is None else total
    flags = wire.FLAG_FIRST | (wire.FLAG_LAST if total is None else 0)
    return wire.encode_prefix(flags, tag, sequence, size, len(header)) + header + payload


def hello(channel: Any, rank: int, size: int, secret: bytes) -> tuple[bytes, bytes, bytes]:
    """The caller's half of the handshake, claiming `rank`: (nonce, session, key)."""
    nonce = os.urandom(wire.NONCE_BYTES)
    metadata = (
        (transport.RANK_METADATA_KEY, str(rank)),
        (transport.SIZE_METADATA_KEY, str(size)),
        (transport.NONCE_METADATA_KEY, nonce),
    )
    call = channel.stream_unary(HELLO, request_serializer=identity, response_deserializer=identity)
    answer = json.loads(call(iter(()), metadata=metadata, timeout=10))
    session = bytes.fromhex(answer["session"])
    return nonce, session, wire.session_key(secret, rank, answer["rank"], size, nonce, session)


def stream_metadata(rank: int, size: int, nonce: bytes, session: bytes, key: bytes) -> tuple[tuple[str, Any], ...]:
    return (
        (transport.RANK_METADATA_KEY, str(rank)),
        (transport.SIZE_METADATA_KEY, str(size)),
        (transport.NONCE_METADATA_KEY, nonce),
        (transport.SESSION_METADATA_KEY, session),
        (transport.PROOF_METADATA_KEY, wire.proof(key, b"client")),
    )


def send_frames(target: str, rank: int, size: int, secret: bytes, frames: Iterable[bytes], timeout: float = 30) -> str:
    """Authenticate to `target` as `rank` and push `frames` down one stream; the final status."""
    with grpc.insecure_channel(target, options=BIG_MESSAGES) as channel:
        metadata = stream_metadata(rank, size, *hello(channel, rank, size, secret))
        stream = channel.stream_unary(STREAM, request_serializer=identity, response_deserializer=identity)
        try:
            stream(iter(frames), metadata=metadata, timeout=timeout)
            return "OK"
        except grpc.RpcError as error:
            return error.code().name


class FakeRank:
    """A server at `address` that passes for rank `rank` of `size` (it holds `secret`)."""

    def __init__(self, address: str, rank: int, size: int, secret: bytes) -> None:
        def answer_hello(requests: Any, context: Any) -> bytes:
            metadata = dict(context.invocation_metadata())
            caller, nonce = int(metadata[transport.RANK_METADATA_KEY]), metadata[transport.NONCE_METADATA_KEY]
            session = os.urandom(wire.NONCE_BYTES + transport.SERVER_COOKIE_BYTES)
            key = wire.session_key(secret, caller, rank, size, nonce, session)
            proof = wire.proof(key, b"server").hex()
            return json.dumps({"rank": rank, "size": size, "session": session.hex(), "proof": proof}).encode()

        def drain(requests: Any, context: Any) -> bytes:
            for _ in requests:
                pass
            return b""

        handlers = {
            "Hello": grpc.stream_unary_rpc_method_handler(answer_hello, identity, identity),
            "Stream": grpc.stream_unary_rpc_method_handler(drain, identity, identity),
            "Abort": grpc.stream_unary_rpc_method_handler(lambda requests, context: b"", identity, identity),
        }
        generic = grpc.method_handlers_generic_handler(transport.SERVICE, handlers)
        self.server = grpc.server(futures.ThreadPoolExecutor(8), handlers=[generic], options=BIG_MESSAGES)
        self.server.add_insecure_port(address)
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0).wait(10)


class _Recorder(grpc.GenericRpcHandler):
    def __init__(self, calls: list[dict[str, Any]], lock: threading.Lock) -> None:
        self.calls, self.lock = calls, lock

    def service(self, details: Any) -> Any:
        record: dict[str, Any] = {"method": details.method, "metadata": list(details.invocation_metadata), "body": []}
        with self.lock:
            self.calls.append(record)

        def answer(requests: Any, context: Any) -> bytes:
            for request in requests:
                record["body"].append(request)
            return b'{"rank": 1, "size": 2, "session": "00", "proof": "00"}'

        return grpc.stream_unary_rpc_method_handler(answer, identity, identity)


class Squatter:
    """A server on `address` without the secret, recording every call made to it."""

    def __init__(self, address: str) -> None:
        self.calls: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(8), handlers=[_Recorder(self.calls, self._lock)], options=BIG_MESSAGES
        )
        if not self.server.add_insecure_port(address):
            raise OSError(f"the squatter cannot bind {address}")
        self.server.start()

    def captured(self) -> bytes:
        """Everything callers sent, as bytes (metadata keys and values, bodies)."""
        parts: list[bytes] = []
        with self._lock:
            for call in self.calls:
                parts.append(call["method"].encode() if isinstance(call["method"], str) else call["method"])
                for key, value in call["metadata"]:
                    parts += [key.encode(), value if isinstance(value, bytes) else value.encode()]
                parts += call["body"]
        return b"\n".join(parts)

    def stop(self) -> None:
        self.server.stop(0).wait(10)
