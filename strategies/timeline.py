"""A Chrome-trace timeline of backprop and bucket communication, to see (and measure) overlap.

Open the file in chrome://tracing or https://ui.perfetto.dev. Each rank writes its own file; the
path comes from the `timeline=` argument or the COLLECTIVES_TIMELINE environment variable (as
Horovod uses HOROVOD_TIMELINE), with `{rank}` replaced by the rank, or `.rank<N>` added before the
extension when there is no `{rank}` and there are several ranks. Events are appended as they
happen, in the JSON-array form Chrome accepts without a closing bracket, so a crashed run still
leaves a readable trace.

`hidden_fraction(events)` is the share of communication time that ran while backprop was still
running: 1.0 means communication was entirely hidden, 0.0 that it all came after.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Sequence

ENV_TIMELINE = "COLLECTIVES_TIMELINE"
BACKPROP = "backprop"
COMMUNICATION = "communication"


class Timeline:
    """Appends complete ("X") trace events to a per-rank file; thread-safe."""

    def __init__(self, path: str | os.PathLike, rank: int = 0, size: int = 1) -> None:
        self.path = rank_path(os.fspath(path), rank, size)
        self.rank = rank
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        with open(self.path, "w") as trace:
            trace.write("[\n")

    @classmethod
    def from_environment(cls, rank: int, size: int) -> Timeline | None:
        """A timeline at $COLLECTIVES_TIMELINE, or None when it is not set."""
        path = os.environ.get(ENV_TIMELINE)
        return cls(path, rank, size) if path else None

    def record(self, name: str, category: str, start: float, end: float, **args: object) -> None:
        """One interval, from `time.perf_counter()` values."""
        event = {
            "name": name,
            "cat": category,
            "ph": "X",
            "ts": round((start - self._origin) * 1e6, 3),
            "dur": round(max(end - start, 0.0) * 1e6, 3),
            "pid": self.rank,
            "tid": category,
            "args": args,
        }
        with self._lock:
            self.events.append(event)
            with open(self.path, "a") as trace:
                trace.write(json.dumps(event) + ",\n")


def rank_path(path: str, rank: int, size: int) -> str:
    """The file rank `rank` writes for the user-given `path`."""
    if "{rank}" in path:
        return path.format(rank=rank)
    if size == 1:
        return path
    stem, extension = os.path.splitext(path)
    return f"{stem}.rank{rank}{extension}"


def load_trace(path: str | os.PathLike) -> list[dict]:
    """The events of a trace file written by `Timeline` (closed or not)."""
    with open(path) as trace:
        text = trace.read().rstrip().rstrip(",")
    return json.loads(text + "]") if not text.endswith("]") else json.loads(text)


def hidden_fraction(events: Iterable[dict], step: int | None = None) -> float:
    """Share of communication time that overlapped backprop (of the same step, or of all steps).

    Events are those of `Timeline` (from `Timeline.events` or `load_trace(path)`); each carries its step
    number in `args["step"]`. Returns 0.0 when there was no communication.
    """
    chosen = [e for e in events if step is None or e.get("args", {}).get("step") == step]
    backprop = [_interval(e) for e in chosen if e["cat"] == BACKPROP]
    communication = [_interval(e) for e in chosen if e["cat"] == COMMUNICATION]
    total = sum(end - start for start, end in communication)
    if total <= 0:
        return 0.0
    hidden = sum(_overlap(interval, backprop) for interval in communication)
    return hidden / total


def _interval(event: dict) -> tuple[float, float]:
    return event["ts"], event["ts"] + event["dur"]


def _overlap(interval: tuple[float, float], others: Sequence[tuple[float, float]]) -> float:
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in others)
