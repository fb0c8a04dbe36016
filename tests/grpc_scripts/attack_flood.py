"""``python attack_flood.py TARGET COUNT BYTES``: a stranger without the secret floods a rank.

For every method a rank's server has had (Ping, which older versions served, Hello, Stream,
Abort), fires COUNT concurrent calls whose bodies are BYTES long, waits for all of them (each
bounded by a deadline), then prints one ``RESULT {json}`` line: the status codes seen per method
and the seconds it took. Ends by itself; opens nothing but client connections to TARGET.
"""

from __future__ import annotations

import collections
import json
import sys
import time

import grpc

METHODS = ("Ping", "Hello", "Stream", "Abort")
CHANNELS = 8
DEADLINE_SECONDS = 60.0


def identity(data: bytes) -> bytes:
    return data


def flood(target: str, count: int, nbytes: int) -> dict[str, dict[str, int]]:
    body = b"\x00" * nbytes
    claims = (("x-collectives-rank", "0"), ("x-collectives-size", "2"))
    options = [("grpc.max_send_message_length", nbytes + 4096)]
    channels = [grpc.insecure_channel(target, options=options) for _ in range(CHANNELS)]
    codes: dict[str, dict[str, int]] = {}
    try:
        for method in METHODS:
            calls = [
                channels[i % CHANNELS]
                .unary_unary(
                    f"/collectives.Transport/{method}", request_serializer=identity, response_deserializer=identity
                )
                .future(body, metadata=claims, timeout=DEADLINE_SECONDS)
                for i in range(count)
            ]
            seen: collections.Counter[str] = collections.Counter()
            for call in calls:
                try:
                    call.result()
                    seen["OK"] += 1
                except grpc.RpcError as error:
                    seen[error.code().name] += 1
            codes[method] = dict(seen)
    finally:
        for channel in channels:
            channel.close()
    return codes


def main(target: str, count: str, nbytes: str) -> int:
    start = time.monotonic()
    codes = flood(target, int(count), int(nbytes))
    print("RESULT " + json.dumps({"codes": codes, "seconds": time.monotonic() - start}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
