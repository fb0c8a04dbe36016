"""A Chrome-trace timeline of backprop and bucket communication, to see (and measure) overlap.

Open the file in https://ui.perfetto.dev or chrome://tracing. Each rank writes its own file; the
path comes from the `timeline=` argument or the COLLECTIVES_TIMELINE environment variable (as
Horovod uses HOROVOD_TIMELINE), with `{rank}` replaced by the rank, or `.rank<N>` added before the
extension when there is no `{rank}` and there are several ranks. `python -m collectives.timeline
merge -o all.json trace.rank*.json` makes one file of all ranks' files.

What a viewer needs is in the file itself: metadata events name each process ("rank N") and each
track (one integer thread id per kind of event: backprop, communication), and every rank's
timestamps are on rank 0's clock, from the offset `synchronize_clocks` measures (at `init()` when
COLLECTIVES_TIMELINE is set), so the ranks' events line up when merged.

Events are written as they happen, in the JSON-array form Chrome accepts without a closing bracket,
so a crashed run still leaves a readable trace; `close()` (also run at interpreter exit) adds the
bracket, so the file of a run that ended normally is strict JSON.

`hidden_fraction(events)` is the share of communication time that ran while backprop was still
running: 1.0 means communication was entirely hidden, 0.0 that it all came after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collectives.communicator import Communicator

ENV_TIMELINE = "COLLECTIVES_TIMELINE"
BACKPROP = "backprop"
COMMUNICATION = "communication"

_CLOCK_ROUNDS = 8
"""All-gathers `synchronize_clocks` spends; the tightest of their bounds is kept."""


@dataclass(frozen=True)
class ClockSync:
    """How this rank's `time.perf_counter()` maps onto rank 0's, and the trace's time zero.

    `offset` is rank 0's clock minus this rank's, known to within `uncertainty` seconds either way;
    `origin` is a moment on rank 0's clock that every rank's timestamps count from.
    """

    offset: float = 0.0
    uncertainty: float = 0.0
    origin: float = 0.0

    def microseconds(self, seconds: float) -> float:
        """A `perf_counter()` reading of this rank as trace time (µs since `origin`, rank 0's clock)."""
        return round((seconds + self.offset - self.origin) * 1e6, 3)


_synchronized: weakref.WeakKeyDictionary[Communicator, ClockSync] = weakref.WeakKeyDictionary()


def synchronize_clocks(comm: Communicator) -> ClockSync:
    """Measure this rank's clock offset to rank 0 (a collective: every rank must call it).

    Each round all-gathers every rank's clock reading at entry together with its reading at the end
    of the previous round. An all-gather cannot finish on a rank before every rank has entered it,
    so rank 0's entry came before this rank's exit and this rank's entry before rank 0's exit, which
    bounds the offset from both sides; the tightest bounds over the rounds are kept and their middle
    is the estimate. The result is cached per communicator, so calling it again costs nothing.
    """
    cached = _synchronized.get(comm)
    if cached is not None:
        return cached
    lower, upper = -np.inf, np.inf
    entered = left = 0.0
    for round_number in range(_CLOCK_ROUNDS + 1):
        previous_entry = entered
        entered = time.perf_counter()
        readings = comm.allgather(np.array([[entered, left]]))  # `left`: this rank's exit of the previous round
        left = time.perf_counter()
        rank0_entry, rank0_previous_exit = readings[0]
        lower = max(lower, rank0_entry - left)  # rank 0 entered before this rank left
        if round_number > 0:  # this rank entered the previous round before rank 0 left it
            upper = min(upper, rank0_previous_exit - previous_entry)
    offset = 0.0 if comm.rank == 0 else (lower + upper) / 2
    origin = float(comm.broadcast(np.array([time.perf_counter()]), root=0)[0])
    sync = ClockSync(offset=float(offset), uncertainty=float(upper - lower) / 2, origin=origin)
    _synchronized[comm] = sync
    return sync


class Timeline:
    """Appends complete ("X") trace events to a per-rank file; thread-safe.

    Args:
        path: the user's path (see `rank_path`).
        rank, size: this rank and the world size.
        clock: this rank's clock against rank 0's (`synchronize_clocks`); the default leaves the
            timestamps on this rank's own clock, counted from when the timeline was made.
    """

    def __init__(self, path: str | os.PathLike, rank: int = 0, size: int = 1, clock: ClockSync | None = None) -> None:
        self.path = rank_path(os.fspath(path), rank, size)
        self.rank = rank
        self.clock = clock if clock is not None else ClockSync(origin=time.perf_counter())
        self.events: list[dict] = []
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._file: IO[str] | None = open(self.path, "w")  # noqa: SIM115 - kept open until close()
        self._file.write("[\n")
        self._separator = ""
        self._write(_metadata("process_name", rank, 0, name=f"rank {rank}"))
        self._write(_metadata("process_sort_index", rank, 0, sort_index=rank))
        self._closer = weakref.finalize(self, _close_file, self._file)  # also run at interpreter exit

    @classmethod
    def for_communicator(cls, path: str | os.PathLike | None, comm: Communicator) -> Timeline | None:
        """A timeline at `path`, else at $COLLECTIVES_TIMELINE, on rank 0's clock; None if neither is set.

        Every rank must call it together when clocks are not yet synchronised (it may run
        `synchronize_clocks`, a collective); `init()` has done that when $COLLECTIVES_TIMELINE is set.
        """
        chosen = path if path is not None else os.environ.get(ENV_TIMELINE)
        if not chosen:
            return None
        return cls(chosen, comm.rank, comm.size, synchronize_clocks(comm))

    def record(self, name: str, category: str, start: float, end: float, **args: object) -> None:
        """One interval, from `time.perf_counter()` values, on the track named `category`."""
        event = {
            "name": name,
            "cat": category,
            "ph": "X",
            "ts": self.clock.microseconds(start),
            "dur": round(max(end - start, 0.0) * 1e6, 3),
            "pid": self.rank,
            "tid": self._track(category),
            "args": args,
        }
        line = json.dumps(event, default=_json_scalar)  # first: an argument JSON cannot hold raises, recording nothing
        with self._lock:
            self.events.append(event)
            self._write_line(line)

    def close(self) -> None:
        """End the file with its closing bracket, making it strict JSON; later events are dropped."""
        with self._lock:
            self._file = None
            self._closer()

    def _track(self, category: str) -> int:
        """The integer thread id of `category`'s track, named by a metadata event when first used."""
        tid = self._tracks.get(category)
        if tid is None:
            with self._lock:
                tid = self._tracks.get(category)
                if tid is None:
                    tid = self._tracks[category] = len(self._tracks) + 1
                    self._write(_metadata("thread_name", self.rank, tid, name=category))
        return tid

    def _write(self, event: dict) -> None:
        self._write_line(json.dumps(event))

    def _write_line(self, line: str) -> None:
        if self._file is None:
            return
        self._file.write(self._separator + line)
        self._file.flush()
        self._separator = ",\n"


def _json_scalar(value: object) -> object:
    """A numpy scalar among an event's arguments (a step count from an array, say) as JSON's."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"a timeline event's arguments must be JSON values, got {type(value).__name__}: {value!r}")


def _metadata(kind: str, pid: int, tid: int, **args: object) -> dict:
    """A metadata ("M") event: how viewers learn the names of processes and threads."""
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _close_file(trace: IO[str]) -> None:
    if not trace.closed:
        trace.write("\n]\n")
        trace.close()


_RANK_FIELD = re.compile(r"\{rank(?::([^{}]*))?\}")
"""`{rank}` in a timeline path, with a format spec or not (`{rank:02d}`)."""


def rank_path(path: str, rank: int, size: int) -> str:
    """The file rank `rank` writes for the user-given `path`: each `{rank}` (or `{rank:02d}`)
    replaced, other braces left as they are; else `.rank<N>` added where there are several ranks."""
    if _RANK_FIELD.search(path):
        return _RANK_FIELD.sub(lambda field: format(rank, field.group(1) or ""), path)
    if size == 1:
        return path
    stem, extension = os.path.splitext(path)
    return f"{stem}.rank{rank}{extension}"


def load_trace(path: str | os.PathLike) -> list[dict]:
    """The events of a trace file written by `Timeline` (closed or not) or by `merge`.

    Raises:
        ValueError: the file is not such a trace (naming it).
    """
    with open(path) as trace:
        text = trace.read().rstrip().rstrip(",")
    try:
        events = json.loads(text if text.endswith("]") else text + "]")
    except json.JSONDecodeError as error:
        raise ValueError(f"{os.fspath(path)} is not a trace file of collectives.timeline: {error}") from None
    if not isinstance(events, list) or not all(isinstance(e, dict) and "ph" in e and "pid" in e for e in events):
        raise ValueError(f"{os.fspath(path)} is not a trace file of collectives.timeline (a JSON array of events)")
    return events


def merge(paths: Sequence[str | os.PathLike], output: str | os.PathLike) -> int:
    """Write the events of every trace in `paths` (one per rank) to `output` as one JSON array.

    Metadata come first, then the events in time order. Returns the number of events written.

    Raises:
        ValueError: two files come from the same rank (the same process id).
    """
    events: list[dict] = []
    ranks: dict[int, str] = {}
    for path in paths:
        loaded = load_trace(path)
        for pid in {event["pid"] for event in loaded}:
            if pid in ranks:
                raise ValueError(f"{os.fspath(path)} and {ranks[pid]} both hold events of rank {pid}")
            ranks[pid] = os.fspath(path)
        events.extend(loaded)
    events.sort(key=lambda event: (event["ph"] != "M", event.get("ts", 0.0), event["pid"]))
    with open(output, "w") as merged:
        merged.write("[\n" + ",\n".join(json.dumps(event) for event in events) + "\n]\n")
    return len(events)


def hidden_fraction(events: Iterable[dict], step: int | None = None) -> float:
    """Share of communication time that overlapped its own rank's backprop (of the same step, or of
    all steps).

    Events are those of `Timeline` (from `Timeline.events`, or `load_trace(path)` of one rank's file
    or of a `merge` of several); each carries its rank as `pid` and its step number in
    `args["step"]`. A rank's communication counts as hidden while any of its backprop intervals
    runs, once however many overlap (in a merged trace, another rank's backprop counted too, and
    the share reached 2.0 with two ranks). Returns 0.0 when there was no communication.
    """
    chosen = [e for e in events if e["ph"] == "X" and (step is None or e.get("args", {}).get("step") == step)]
    backprop: dict[object, list[tuple[float, float]]] = {}
    for event in chosen:
        if event["cat"] == BACKPROP:
            backprop.setdefault(event.get("pid"), []).append(_interval(event))
    running = {pid: _union(intervals) for pid, intervals in backprop.items()}
    communication = [(e.get("pid"), _interval(e)) for e in chosen if e["cat"] == COMMUNICATION]
    total = sum(end - start for _, (start, end) in communication)
    if total <= 0:
        return 0.0
    hidden = sum(_overlap(interval, running.get(pid, [])) for pid, interval in communication)
    return hidden / total


def _interval(event: dict) -> tuple[float, float]:
    return event["ts"], event["ts"] + event["dur"]


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The same time as `intervals`, as disjoint intervals in order."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(interval: tuple[float, float], others: Sequence[tuple[float, float]]) -> float:
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in others)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m collectives.timeline", description="Work with the per-rank trace files of a run."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    merging = commands.add_parser("merge", help="one trace file of every rank's, for Perfetto or chrome://tracing")
    merging.add_argument("traces", nargs="+", help="the ranks' files (e.g. trace.rank*.json)")
    merging.add_argument("-o", "--output", required=True, help="the merged file to write")
    args = parser.parse_args(argv)
    try:
        count = merge(args.traces, args.output)
    except (OSError, ValueError) as error:  # json.JSONDecodeError is a ValueError
        parser.exit(1, f"python -m collectives.timeline merge: {error}\n")
    print(f"wrote {count} events of {len(args.traces)} file(s) to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
