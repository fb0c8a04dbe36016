"""collectives.timeline: per-rank trace files a viewer understands, clocks aligned to rank 0, and
`python -m collectives.timeline merge`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import test_launch

from collectives import run_threads, timeline
from collectives.timeline import (
    BACKPROP,
    COMMUNICATION,
    ClockSync,
    Timeline,
    hidden_fraction,
    load_trace,
    merge,
    rank_path,
)


def test_rank_paths() -> None:
    """A format spec is honoured, other braces kept (they raised KeyError)."""
    assert rank_path("t.json", 0, 1) == "t.json"
    assert rank_path("t.json", 2, 4) == "t.rank2.json"
    assert rank_path("t-{rank}.json", 3, 4) == "t-3.json"
    assert rank_path("t{rank:02d}.json", 3, 4) == "t03.json"
    assert rank_path("t-{rank}-{host}.json", 1, 2) == "t-1-{host}.json"


def test_an_argument_json_cannot_hold_records_nothing_and_numpy_scalars_are_held(tmp_path: Path) -> None:
    """step=np.int64(1) raised TypeError after the event was in `events` but not in the file."""
    trace = Timeline(tmp_path / "t.json", rank=0, size=1, clock=ClockSync(origin=0.0))
    trace.record("bucket 0", COMMUNICATION, 1.0, 2.0, step=np.int64(1), fraction=np.float32(0.5))
    with pytest.raises(TypeError, match="JSON values"):
        trace.record("bucket 1", COMMUNICATION, 2.0, 3.0, step=object())
    trace.close()
    spans = [e for e in load_trace(tmp_path / "t.json") if e["ph"] == "X"]
    assert [(e["name"], e["args"]) for e in spans] == [("bucket 0", {"step": 1, "fraction": 0.5})]
    assert [e["name"] for e in trace.events] == ["bucket 0"]


def test_hidden_fraction_of_a_merged_trace_counts_each_rank_against_its_own_backprop(tmp_path: Path) -> None:
    """Two ranks, each hiding its bucket entirely: the merged trace said 2.0 (each bucket counted
    against both ranks' backprop). Overlapping backprop intervals of one rank count once."""
    paths = []
    for rank in range(2):
        trace = Timeline(tmp_path / "t.json", rank=rank, size=2, clock=ClockSync(origin=0.0))
        trace.record("backprop", BACKPROP, 1.000, 1.010, step=1)
        trace.record("backprop again", BACKPROP, 1.001, 1.009, step=1)
        trace.record("bucket 0", COMMUNICATION, 1.002, 1.008, step=1)
        trace.close()
        paths.append(trace.path)
    merge(paths, tmp_path / "all.json")
    assert hidden_fraction(load_trace(tmp_path / "all.json")) == pytest.approx(1.0)


def test_trace_names_its_process_and_tracks_and_is_strict_json_once_closed(tmp_path: Path) -> None:
    """Perfetto needs integer thread ids and metadata naming them; an unclosed file (a crash) still
    loads, and a closed one is strict JSON."""
    trace = Timeline(tmp_path / "trace.json", rank=1, size=2)
    origin = trace.clock.origin
    trace.record("backprop", "backprop", origin + 0.0, origin + 0.010, step=1)
    trace.record("bucket 0", "communication", origin + 0.006, origin + 0.014, step=1)
    trace.record("bucket 1", "communication", origin + 0.014, origin + 0.016, step=1)
    path = tmp_path / "trace.rank1.json"
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())  # still open: the JSON-array form Chrome accepts unclosed
    unclosed = load_trace(path)
    trace.close()
    events = json.loads(path.read_text())
    assert events == unclosed

    metadata = [e for e in events if e["ph"] == "M"]
    assert {(e["name"], e["tid"], json.dumps(e["args"])) for e in metadata} == {
        ("process_name", 0, '{"name": "rank 1"}'),
        ("process_sort_index", 0, '{"sort_index": 1}'),
        ("thread_name", 1, '{"name": "backprop"}'),
        ("thread_name", 2, '{"name": "communication"}'),
    }
    spans = [e for e in events if e["ph"] == "X"]
    assert [(e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in spans] == [
        ("backprop", 1, 1, 0.0, 10000.0),
        ("bucket 0", 1, 2, 6000.0, 8000.0),
        ("bucket 1", 1, 2, 14000.0, 2000.0),
    ]
    assert spans == json.loads(json.dumps(trace.events))
    assert hidden_fraction(events) == pytest.approx(0.4)  # 4 ms of 10 ms overlapped
    assert hidden_fraction(events, step=2) == 0.0

    trace.record("late", "communication", origin, origin + 1)  # after close: dropped, file stays valid
    assert json.loads(path.read_text()) == events


def test_timestamps_are_on_rank_0s_clock() -> None:
    sync = ClockSync(offset=2.5, origin=100.0)
    assert sync.microseconds(98.0) == pytest.approx(500_000.0)


def test_clock_offsets_are_measured_to_within_their_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's clock runs `skew[rank]` seconds ahead; the measured offsets recover the skews."""
    skew = [0.0, 3.25, -1.5, 1000.0]
    current = threading.local()
    real = time.perf_counter
    monkeypatch.setattr(timeline, "time", types.SimpleNamespace(perf_counter=lambda: real() + skew[current.rank]))

    def body(comm):
        current.rank = comm.rank
        return timeline.synchronize_clocks(comm), timeline.synchronize_clocks(comm)

    results = run_threads(body, world_size=4, timeout=60)
    for rank, (sync, again) in enumerate(results):
        assert again is sync, "the offset is measured once per communicator"
        expected = skew[0] - skew[rank]
        assert abs(sync.offset - expected) <= sync.uncertainty + 1e-9, (rank, sync)
        assert sync.uncertainty < 1.0, sync  # bounds from both sides, not only one
        assert sync.origin == results[0][0].origin, "every rank counts from the same moment"


def _write_rank_trace(directory: Path, rank: int, start: float) -> Path:
    trace = Timeline(directory / "t.json", rank=rank, size=2, clock=ClockSync(origin=0.0))
    trace.record(f"bucket of rank {rank}", "communication", start, start + 0.001)
    trace.close()
    return Path(trace.path)


def test_merge_puts_every_rank_in_one_valid_file(tmp_path: Path) -> None:
    paths = [_write_rank_trace(tmp_path, 0, 2.0), _write_rank_trace(tmp_path, 1, 1.0)]
    merged = tmp_path / "all.json"
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "collectives.timeline", "merge", "-o", str(merged), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not result.stderr, result.stderr  # it warned: imported twice
    events = json.loads(merged.read_text())
    kinds = [e["ph"] for e in events]
    assert kinds == sorted(kinds, key=lambda ph: ph != "M"), "metadata first"
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["bucket of rank 1", "bucket of rank 0"], "in time order"
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"rank 0", "rank 1"}


def test_merge_refuses_two_files_of_one_rank(tmp_path: Path) -> None:
    path = _write_rank_trace(tmp_path, 0, 1.0)
    with pytest.raises(ValueError, match="both hold events of rank 0"):
        merge([path, path], tmp_path / "all.json")


@pytest.mark.parametrize("content", ['{"a": 1}', "not json", '[{"no": "phase"}]', "[1, 2]"])
def test_merge_names_a_file_that_is_not_a_trace(tmp_path: Path, content: str) -> None:
    """It said only "Extra data: line 1 column 8 (char 7)", or failed with a KeyError."""
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{re.escape(str(path))} is not a trace file of collectives.timeline"):
        merge([_write_rank_trace(tmp_path, 0, 1.0), path], tmp_path / "all.json")


def test_launched_ranks_write_aligned_traces_that_merge(tmp_path: Path) -> None:
    """COLLECTIVES_TIMELINE on real gRPC ranks: `init()` synchronises the clocks, each rank's file
    is strict JSON when the script ends without closing it, and the files merge."""
    result = test_launch.launch(
        tmp_path,
        f"""
        import os, time
        os.environ["COLLECTIVES_TIMELINE"] = {str(tmp_path / "trace.json")!r}
        import collectives
        from collectives.timeline import Timeline, synchronize_clocks

        comm = collectives.init()
        sync = synchronize_clocks(comm)  # measured by init(): cached
        trace = Timeline.for_communicator(None, comm)
        assert trace.clock is sync, trace.clock
        comm.barrier()
        now = time.perf_counter()
        trace.record("after the barrier", "communication", now, now + 0.001, rank=comm.rank)
        print("uncertainty", sync.uncertainty)
        """,
        "-n",
        "2",
        "--backend",
        "grpc",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    paths = [tmp_path / f"trace.rank{rank}.json" for rank in range(2)]
    for path in paths:
        json.loads(path.read_text())  # strict JSON: closed at interpreter exit
    merge(paths, tmp_path / "all.json")
    spans = [e for e in json.loads((tmp_path / "all.json").read_text()) if e["ph"] == "X"]
    assert sorted(e["pid"] for e in spans) == [0, 1]
