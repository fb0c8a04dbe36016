"""`python -m collectives.bench.tf_compare`: argument parsing, the reduction of per-rank timings to figures,
and the tables, on fake results (no processes, no TensorFlow); plus one end-to-end smoke run of all
three groups at one tiny size, skipped where TensorFlow, mpi4py or grpcio is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from collectives.bench.tf_compare import (
    GroupSummary,
    allreduce_table,
    breakdown_table,
    combine,
    format_size,
    format_time,
    parse_groups,
    parse_size,
    parse_sizes,
    summarize,
    targets,
    train_table,
    worker_command,
)
from collectives.bench.tf_compare import main as tf_compare_main
from collectives.bench.tf_workers import WorkerConfig

KIB, MIB = 1 << 10, 1 << 20
SMOKE_TIMEOUT = 150


def fake_rank(rank: int, *, scale: float, side: str = "ours") -> dict:
    """A worker's JSON, the ranks taking turns at being the slowest."""
    slow_first = [3.0, 1.0, 1.0] if rank else [1.0, 2.0, 2.0]
    times = {str(n): [t * scale * (n // KIB) for t in slow_first] for n in (4 * KIB, 16 * MIB)}
    variants = ("function",) if side == "mwms" else ("numpy", "eager", "function")
    return {
        "side": side,
        "rank": rank,
        "size": 2,
        "backend": "mpi",
        "allreduce": {variant: times for variant in variants},
        "wrong": {variant: 0 for variant in variants},
        "train": {
            "eager": [scale * t for t in ([2, 1, 2] if rank else [1, 2, 1])],
            "function": [scale] * 3,
            "local-function": [scale / 4] * 3,
        },
        "hidden": {"eager": 0.5 + 0.1 * rank, "function": 0.7},
        "checksum": {"eager": 10.0, "function": 10.0 + rank},
        "algorithms": {str(4 * KIB): "ring"},
    }


def test_sizes_parse_like_the_other_benchmarks() -> None:
    assert parse_size("4K") == 4096
    assert parse_size("16MiB") == 16 * MIB
    assert parse_size("1048576") == MIB
    assert parse_sizes("16M, 4K,4K") == (4096, 16 * MIB)
    for bad in ("lots", "6", "-4K"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_groups_keep_the_canonical_order_and_reject_unknown_names() -> None:
    assert parse_groups("grpc,mwms") == ("mwms", "grpc")
    with pytest.raises(argparse.ArgumentTypeError, match="some of mwms,mpi,grpc"):
        parse_groups("nccl")


def test_formatting_of_sizes_and_times() -> None:
    assert [format_size(n) for n in (4096, 16 * MIB, 6000)] == ["4 KiB", "16 MiB", "6000 B"]
    assert [format_time(t) for t in (250e-6, 39e-3, None)] == ["250 us", "39.00 ms", "-"]


def test_summary_takes_the_median_of_the_slowest_rank_per_iteration() -> None:
    summary = summarize("mpi", [fake_rank(0, scale=1e-6), fake_rank(1, scale=1e-6)])
    # slowest per iteration: max(1, 3), max(2, 1), max(2, 1) -> 3, 2, 2 (times 4 for 4 KiB)
    assert summary.allreduce["eager"][4 * KIB] == pytest.approx(8e-6)
    assert summary.train["eager"] == pytest.approx(2e-6) and summary.train["function"] == pytest.approx(1e-6)
    assert summary.hidden["eager"] == pytest.approx(0.55)
    assert summary.in_sync == {"eager": True, "function": False}
    assert summary.algorithms == {4 * KIB: "ring"}
    assert summary.wrong == 0


def test_rounds_combine_by_median_and_failed_rounds_are_left_out() -> None:
    rounds = [
        GroupSummary("mpi", train={"eager": t}, allreduce={"eager": {4096: t}}, in_sync={"eager": True})
        for t in (1.0, 5.0, 2.0)
    ]
    failed = GroupSummary("mpi", error="timed out")
    combined = combine([*rounds, failed])
    assert combined.train["eager"] == 2.0 and combined.allreduce["eager"][4096] == 2.0
    assert combined.in_sync == {"eager": True}
    assert combine([failed]).error == "timed out"


def results() -> dict[str, GroupSummary]:
    mwms = summarize("mwms", [fake_rank(r, scale=500e-6, side="mwms") for r in (0, 1)])
    mpi = summarize("mpi", [fake_rank(r, scale=50e-6) for r in (0, 1)])
    grpc = GroupSummary("grpc", error="exit codes [1]")
    return {"mwms": mwms, "mpi": mpi, "grpc": grpc}


def test_tables_show_times_speedups_and_failures() -> None:
    sizes = (4 * KIB, 16 * MIB)
    table = allreduce_table(results(), sizes)
    lines = table.splitlines()
    assert lines[0].split("|")[1].strip() == "size" and "MWMS" in lines[0]
    assert len(lines) == 2 + len(sizes)
    assert "4 KiB" in lines[2] and "4.00 ms" in lines[2] and "400 us" in lines[2] and "10.0x" in lines[2]
    assert "ring" in lines[2]
    breakdown = breakdown_table(results(), sizes)
    assert "grpc" not in breakdown and breakdown.count("mpi") == len(sizes)
    train = train_table(results())
    assert "ours MPI eager" in train and "ours MPI tf.function" in train and "failed" in train
    assert "55%" in train and "NO" in train and "local" not in train
    function_row = next(line for line in train.splitlines() if "ours MPI tf.function" in line)
    assert [cell.strip() for cell in function_row.split("|")[2:6]] == ["50 us", "10.0x", "12 us", "38 us"]


def test_targets_say_met_or_missed_with_the_deciding_figure() -> None:
    lines = targets(results(), (4 * KIB, 16 * MIB))
    assert "met    MPI all-reduce >= 5x MWMS at 4 KiB: 10.0x" in lines
    assert "met    MPI all-reduce >= 5x MWMS at 16 MiB: 10.0x" in lines
    assert "MISSED MPI all-reduce < 60 us at 4 KiB: 400 us" in lines
    assert any(line.startswith("met    mpi training step (function)") for line in lines)
    assert not any("gRPC" in line for line in lines)  # the failed group decides nothing


def test_worker_commands() -> None:
    config = WorkerConfig(sizes=(4096,), repeats=1, warmup=0, batch=8)
    assert WorkerConfig.from_json(config.to_json()) == config
    mwms = worker_command("mwms", config, Path("/tmp/x"))
    assert mwms[1:4] == ["-m", "collectives.bench.tf_workers", "mwms"]
    grpc = worker_command("grpc", config, Path("/tmp/x"))
    assert grpc[1:8] == ["-m", "collectives.launch", "-n", "2", "--backend", "grpc", "-m"]
    assert grpc[8:10] == ["collectives.bench.tf_workers", "ours"]


needs = [name for name in ("tensorflow", "mpi4py", "grpc") if importlib.util.find_spec(name) is None]


@pytest.mark.skipif(bool(needs), reason=f"needs {', '.join(needs)}")
def test_end_to_end_smoke(tmp_path: Path) -> None:
    """All three groups at 4 KiB, one repeat, one round: every figure present, nothing wrong."""
    out = tmp_path / "figures.json"
    command = [
        sys.executable, "-m", "collectives.bench.tf_compare",
        "--sizes", "4K", "--repeats", "1", "--warmup", "1", "--rounds", "1", "--batch", "8",
        "--timeout", "120", "--json", str(out),
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=SMOKE_TIMEOUT, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "All-reduce of a TF tensor" in run.stdout and "Targets:" in run.stdout
    document = json.loads(out.read_text())
    for group in ("mwms", "mpi", "grpc"):
        summary = document["median"][group]
        assert summary["error"] is None and summary["wrong"] == 0
        assert summary["allreduce"]["function"]["4096"] > 0
        assert all(summary["in_sync"].values())
        if group != "mwms":
            assert summary["train"]["fit"] > 0 and summary["in_sync"]["fit"]


def test_missing_tensorflow_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Without TensorFlow: one line naming the extra, before any worker starts (not a traceback per group)."""
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    assert tf_compare_main(["--rounds", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "collectives.bench.tf_compare needs TensorFlow: pip install -e '.[tf]'\n"
