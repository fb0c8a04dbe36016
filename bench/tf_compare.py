"""`python -m collectives.bench.tf_compare`: our TF all-reduce and training step vs MultiWorkerMirroredStrategy.

Three groups of 2 processes each run on this machine, one group at a time:

* `mwms`: `tf.distribute.MultiWorkerMirroredStrategy` (CommunicationImplementation.RING, what ships
  with TensorFlow), started with a `TF_CONFIG` per worker on free loopback ports;
* `mpi`: our `strategies` API over MPI (`python -m collectives.launch --backend mpi`, the venv's
  mpiexec);
* `grpc`: the same over gRPC (`python -m collectives.launch --backend grpc`).

Each group times the all-reduce of a float32 tensor at every size (each iteration right after a
barrier, the slowest rank's time, median over iterations) and the training step of the example
model (examples/train_keras.py's `build_model`, the same per-rank batch everywhere). The worker
code is in `collectives.bench.tf_workers`. Process groups cannot be interleaved iteration by iteration the way
`collectives.bench.measure` interleaves algorithms, so the groups run alternately for `--rounds` rounds and
every figure is the median over rounds of the per-round medians: a burst of noise on this shared
machine then hits one round of one group, not one side of the comparison.

It prints three tables and the issue's targets, each "met" or "MISSED" with its figure:

* all-reduce: MWMS, ours over MPI and gRPC (eager and in a `tf.function`), the eager speedups and
  the algorithm our selector chose;
* where our time goes: the communicator on numpy arrays (auto, and MPI's native all-reduce) next
  to `collectives.strategies.allreduce` on a tensor, measured alternately in the same processes;
* training step: MWMS and ours (eager, `tf.function`, and `model.fit` with `DistributedOptimizer`),
  the same step with a plain tape (or plain optimizer) and no communication, the difference
  (communication left exposed), the timeline's hidden fraction, and whether the ranks ended with
  identical weights.

Every group runs under a timeout; on timeout or failure only the processes this module started
are stopped: the launcher (by its process group) and each rank (by the pid it wrote at start-up).

    python -m collectives.bench.tf_compare                                  # 4 KiB .. 16 MiB, 3 rounds
    python -m collectives.bench.tf_compare --sizes 4K,16M --repeats 50 --json figures.json
    python -m collectives.bench.tf_compare --groups mpi --bucket-kib 16     # smaller gradient buckets
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from collectives.launch import free_loopback_ports

from .tf_workers import LOCAL, WorkerConfig

GROUPS = ("mwms", "mpi", "grpc")
WORLD_SIZE = 2
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M"
_REPO = Path(__file__).resolve().parent.parent
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_STOP_GRACE_SECONDS = 5.0
_LOG_TAIL_LINES = 25
_SYNC_TOLERANCE = 1e-6
"""Relative difference allowed between ranks' weight checksums (all-reduce results are identical
on every rank, so the weights should agree to rounding of the checksum itself)."""
_TF_CHATTER = re.compile(r"^(\[\d+\] )?([IWE]\d{4} \d\d:\d\d:|WARNING: All log messages before absl)")


class GroupFailed(RuntimeError):
    """A group of worker processes exited non-zero, timed out or wrote no results."""


@dataclass(frozen=True)
class GroupSummary:
    """One group's figures: seconds, medians of the slowest rank (over iterations or rounds)."""

    group: str
    backend: str = ""
    allreduce: dict[str, dict[int, float]] = field(default_factory=dict)
    """Variant ("eager", "function", "numpy", "numpy-native") -> payload bytes -> seconds."""
    train: dict[str, float] = field(default_factory=dict)
    """Variant -> seconds per training step."""
    hidden: dict[str, float] = field(default_factory=dict)
    """Variant -> fraction of communication time hidden behind backprop."""
    algorithms: dict[int, str] = field(default_factory=dict)
    """Payload bytes -> the algorithm our communicator chose for it."""
    wrong: int = 0
    """All-reduce result elements that differed from the exact sum, over every rank and variant."""
    in_sync: dict[str, bool] = field(default_factory=dict)
    """Variant -> whether every rank ended training with the same weights."""
    error: str | None = None


def parse_size(text: str) -> int:
    """'4K', '16M', '1G' or a plain byte count, as bytes (a multiple of 4: float32 payloads)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _UNITS else ""
    try:
        value = int(float(text[: len(text) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4K, 16M or 1048576)") from None
    if value < 4 or value % 4:
        raise argparse.ArgumentTypeError(f"size must be a positive multiple of 4 bytes (float32), got {text!r}")
    return value


def parse_sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of sizes, e.g. '4K,1M,16M', sorted and without repeats."""
    return tuple(sorted({parse_size(part) for part in text.split(",") if part.strip()}))


def parse_groups(text: str) -> tuple[str, ...]:
    """A comma-separated subset of `GROUPS`, kept in the canonical order."""
    chosen = {part.strip() for part in text.split(",") if part.strip()}
    unknown = chosen - set(GROUPS)
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"groups must be some of {','.join(GROUPS)}, got {text!r}")
    return tuple(group for group in GROUPS if group in chosen)


def format_size(nbytes: int) -> str:
    """4096 -> '4 KiB', 16777216 -> '16 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def format_time(seconds: float | None) -> str:
    """Microseconds below 1 ms, milliseconds above; '-' when not measured."""
    if seconds is None:
        return "-"
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def format_ratio(baseline: float | None, ours: float | None) -> str:
    """How many times faster `ours` is than `baseline` ('-' when either is missing)."""
    if baseline is None or ours is None or ours <= 0:
        return "-"
    return f"{baseline / ours:.1f}x"


def summarize(group: str, ranks: Sequence[Mapping]) -> GroupSummary:
    """One run's per-rank raw timings -> the slowest rank's median for every measurement.

    All-reduce iteration i started after a barrier on every rank, so max over ranks of iteration i
    is when that collective was done everywhere; training steps run back to back, their ranks are
    coupled by the gradient all-reduce, and the same element-wise maximum applies.
    """
    allreduce: dict[str, dict[int, float]] = {}
    for variant, by_size in ranks[0]["allreduce"].items():
        allreduce[variant] = {
            int(nbytes): _median_of_slowest([rank["allreduce"][variant][nbytes] for rank in ranks])
            for nbytes in by_size
        }
    train = {variant: _median_of_slowest([rank["train"][variant] for rank in ranks]) for variant in ranks[0]["train"]}
    hidden = {
        variant: statistics.fmean(rank["hidden"][variant] for rank in ranks) for variant in ranks[0].get("hidden", {})
    }
    in_sync = {}
    for variant, reference in ranks[0].get("checksum", {}).items():
        scale = max(abs(reference), 1.0)
        in_sync[variant] = all(abs(rank["checksum"][variant] - reference) <= _SYNC_TOLERANCE * scale for rank in ranks)
    return GroupSummary(
        group=group,
        backend=ranks[0]["backend"],
        allreduce=allreduce,
        train=train,
        hidden=hidden,
        algorithms={int(nbytes): name for nbytes, name in ranks[0].get("algorithms", {}).items()},
        wrong=sum(sum(rank["wrong"].values()) for rank in ranks),
        in_sync=in_sync,
    )


def _median_of_slowest(per_rank: Sequence[Sequence[float]]) -> float:
    return statistics.median(max(times) for times in zip(*per_rank))


def combine(rounds: Sequence[GroupSummary]) -> GroupSummary:
    """The median over rounds of each figure; failed rounds are left out (all failed: the error)."""
    done = [summary for summary in rounds if summary.error is None]
    if not done:
        return rounds[-1]
    first = done[0]
    return GroupSummary(
        group=first.group,
        backend=first.backend,
        allreduce={
            variant: {n: statistics.median(s.allreduce[variant][n] for s in done) for n in by_size}
            for variant, by_size in first.allreduce.items()
        },
        train={variant: statistics.median(s.train[variant] for s in done) for variant in first.train},
        hidden={variant: statistics.median(s.hidden[variant] for s in done) for variant in first.hidden},
        algorithms=first.algorithms,
        wrong=sum(s.wrong for s in done),
        in_sync={variant: all(s.in_sync[variant] for s in done) for variant in first.in_sync},
    )


def allreduce_table(results: Mapping[str, GroupSummary], sizes: Sequence[int]) -> str:
    """Size, MWMS, ours over MPI and gRPC (eager, tf.function) and the eager speedups over MWMS."""
    columns = [
        ("size", 8),
        ("MWMS", 10),
        ("MPI eager", 10),
        ("MPI tf.fn", 10),
        ("gRPC eager", 10),
        ("gRPC tf.fn", 10),
        ("MPI/MWMS", 9),
        ("gRPC/MWMS", 9),
        ("MPI algo", 9),
    ]
    lines = [_row([name for name, _ in columns], columns), _rule(columns)]
    for nbytes in sizes:
        base = _figure(results, "mwms", "function", nbytes)
        mpi = _figure(results, "mpi", "eager", nbytes)
        grpc = _figure(results, "grpc", "eager", nbytes)
        cells = [
            format_size(nbytes),
            format_time(base),
            format_time(mpi),
            format_time(_figure(results, "mpi", "function", nbytes)),
            format_time(grpc),
            format_time(_figure(results, "grpc", "function", nbytes)),
            format_ratio(base, mpi),
            format_ratio(base, grpc),
            results["mpi"].algorithms.get(nbytes, "-") if "mpi" in results else "-",
        ]
        lines.append(_row(cells, columns))
    return "\n".join(lines)


def breakdown_table(results: Mapping[str, GroupSummary], sizes: Sequence[int]) -> str:
    """Where our time goes: the communicator on numpy arrays (auto, MPI's native) next to
    `collectives.strategies.allreduce` on a tensor; the difference is what the TensorFlow layer costs."""
    columns = [
        ("size", 8),
        ("backend", 7),
        ("numpy auto", 10),
        ("numpy native", 12),
        ("TF eager", 9),
        ("TF overhead", 11),
    ]
    lines = [_row([name for name, _ in columns], columns), _rule(columns)]
    for group in ("mpi", "grpc"):
        if group not in results or results[group].error is not None:
            continue
        for nbytes in sizes:
            raw = _figure(results, group, "numpy", nbytes)
            eager = _figure(results, group, "eager", nbytes)
            overhead = None if raw is None or eager is None else max(eager - raw, 0.0)
            cells = [
                format_size(nbytes),
                group,
                format_time(raw),
                format_time(_figure(results, group, "numpy-native", nbytes)),
                format_time(eager),
                format_time(overhead),
            ]
            lines.append(_row(cells, columns))
    return "\n".join(lines)


def train_table(results: Mapping[str, GroupSummary]) -> str:
    """One row per (group, variant): step time, speedup over MWMS, the same step with no
    communication (a plain tf.GradientTape, both ranks training at once), the difference (the
    communication left exposed), the timeline's hidden fraction and whether the ranks agree."""
    columns = [
        ("run", 22),
        ("step", 9),
        ("vs MWMS", 7),
        ("no-comm step", 12),
        ("exposed", 9),
        ("hidden", 6),
        ("in sync", 7),
    ]
    lines = [_row([name for name, _ in columns], columns), _rule(columns)]
    base = results["mwms"].train.get("function") if "mwms" in results else None
    labels = {"mwms": "MWMS", "mpi": "ours MPI", "grpc": "ours gRPC"}
    for group, summary in results.items():
        if summary.error is not None:
            lines.append(_row([labels[group], "failed", *["-"] * (len(columns) - 2)], columns))
            continue
        for variant, seconds in summary.train.items():
            if variant.startswith(LOCAL):
                continue
            local = summary.train.get(LOCAL + variant)
            hidden = summary.hidden.get(variant)
            sync = summary.in_sync.get(variant)
            cells = [
                f"{labels[group]} {'tf.function' if variant == 'function' else variant}",
                format_time(seconds),
                format_ratio(base, seconds),
                format_time(local),
                "-" if local is None else format_time(max(seconds - local, 0.0)),
                "-" if hidden is None else f"{hidden:.0%}",
                "-" if sync is None else ("yes" if sync else "NO"),
            ]
            lines.append(_row(cells, columns))
    return "\n".join(lines)


def targets(results: Mapping[str, GroupSummary], sizes: Sequence[int]) -> list[str]:
    """The issue's targets, each as 'met' or 'MISSED' with the figure that decides it."""
    lines = []

    def verdict(ok: bool) -> str:
        return "met   " if ok else "MISSED"

    for nbytes in (4096, 16 << 20):
        base, mpi = _figure(results, "mwms", "function", nbytes), _figure(results, "mpi", "eager", nbytes)
        if nbytes in sizes and base is not None and mpi is not None:
            lines.append(
                f"{verdict(base >= 5 * mpi)} MPI all-reduce >= 5x MWMS at {format_size(nbytes)}: {base / mpi:.1f}x"
            )
    mpi_small = _figure(results, "mpi", "eager", 4096)
    if 4096 in sizes and mpi_small is not None:
        lines.append(f"{verdict(mpi_small < 60e-6)} MPI all-reduce < 60 us at 4 KiB: {format_time(mpi_small)}")
    grpc_ratios = [
        (nbytes, _figure(results, "mwms", "function", nbytes), _figure(results, "grpc", "eager", nbytes))
        for nbytes in sizes
    ]
    measured = [(n, b / g) for n, b, g in grpc_ratios if b is not None and g is not None]
    if measured:
        worst_size, worst = min(measured, key=lambda item: item[1])
        lines.append(
            f"{verdict(worst > 1)} gRPC all-reduce faster than MWMS at every size: "
            f"worst {worst:.2f}x at {format_size(worst_size)}"
        )
    base_step = results["mwms"].train.get("function") if "mwms" in results else None
    for group in ("mpi", "grpc"):
        if base_step is None or group not in results:
            continue
        for variant, seconds in results[group].train.items():
            if variant.startswith(LOCAL):
                continue
            speedup = base_step / seconds
            lines.append(
                f"{verdict(seconds < base_step)} {group} training step ({variant}) faster than MWMS: {speedup:.2f}x"
            )
    return lines


def _figure(results: Mapping[str, GroupSummary], group: str, variant: str, nbytes: int) -> float | None:
    summary = results.get(group)
    if summary is None or summary.error is not None:
        return None
    return summary.allreduce.get(variant, {}).get(nbytes)


def _row(cells: Sequence[str], columns: Sequence[tuple[str, int]]) -> str:
    return "| " + " | ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns)) + " |"


def _rule(columns: Sequence[tuple[str, int]]) -> str:
    return "|" + "|".join("-" * (width + 1) + ":" for _, width in columns) + "|"


def worker_command(group: str, config: WorkerConfig, out: Path) -> list[str]:
    """The command line of one rank (mwms) or of the whole group (launcher for mpi and grpc)."""
    worker = [
        "-m",
        "collectives.bench.tf_workers",
        "mwms" if group == "mwms" else "ours",
        "--config",
        config.to_json(),
        "--out",
        str(out),
    ]
    if group == "mwms":
        return [sys.executable, *worker]
    launch = [sys.executable, "-m", "collectives.launch", "-n", str(WORLD_SIZE), "--backend", group, "-m"]
    return [*launch, *worker[1:]]


def clean_environment() -> dict[str, str]:
    """This process's environment without anything that would tell a worker how to start up.

    A stray TF_CONFIG or COLLECTIVES_* (or an outer MPI job's PMI_* variables) would make
    `collectives.init()` or MWMS join the wrong cluster.
    """
    drop = ("TF_CONFIG", "COLLECTIVES_", "PMI_", "PMIX_", "OMPI_", "MPI_LOCALRANKID", "HYDRA_")
    env = {name: value for name, value in os.environ.items() if not name.startswith(drop)}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def run_group(group: str, config: WorkerConfig, timeout: float) -> list[dict]:
    """Start one group, wait at most `timeout` seconds, return every rank's results (rank order)."""
    with tempfile.TemporaryDirectory(prefix=f"tf_compare_{group}_") as folder:
        out = Path(folder)
        env = clean_environment()
        processes: list[subprocess.Popen] = []
        logs = [out / f"log{i}" for i in range(WORLD_SIZE if group == "mwms" else 1)]
        try:
            if group == "mwms":
                addresses = [f"127.0.0.1:{port}" for port in free_loopback_ports(WORLD_SIZE)]
                for index, log in enumerate(logs):
                    tf_config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
                    worker_env = {**env, "TF_CONFIG": json.dumps(tf_config)}
                    processes.append(_start(worker_command(group, config, out), worker_env, log))
            else:
                processes.append(_start(worker_command(group, config, out), env, logs[0]))
            codes = _wait_all(processes, time.monotonic() + timeout)
        except BaseException:
            _stop(processes, out)
            raise
        if codes is None:
            _stop(processes, out)
            raise GroupFailed(f"{group}: no result within {timeout:g} s\n{_tails(logs)}")
        if any(code != 0 for code in codes):
            _stop(processes, out)
            raise GroupFailed(f"{group}: exit codes {codes}\n{_tails(logs)}")
        missing = [rank for rank in range(WORLD_SIZE) if not (out / f"rank{rank}.json").exists()]
        if missing:
            raise GroupFailed(f"{group}: ranks {missing} wrote no results\n{_tails(logs)}")
        return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


def _start(command: Sequence[str], env: Mapping[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as sink:
        return subprocess.Popen(
            command,
            cwd=_REPO,
            env=dict(env),
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopping it touches nothing else
        )


def _wait_all(processes: Sequence[subprocess.Popen], deadline: float) -> list[int] | None:
    """Every exit code, or None at the deadline; returns early when one fails."""
    while time.monotonic() < deadline:
        codes = [process.poll() for process in processes]
        if None not in codes or any(code not in (None, 0) for code in codes):
            return [-1 if code is None else code for code in codes]
        time.sleep(0.1)
    return None


def _stop(processes: Sequence[subprocess.Popen], out: Path) -> None:
    """SIGINT (the launcher then stops its ranks), SIGTERM, then SIGKILL; ranks also by their pid."""
    rank_pids = []
    for pid_file in out.glob("pid*"):
        try:
            rank_pids.append(int(pid_file.read_text()))
        except ValueError:
            continue
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        alive = [process for process in processes if process.poll() is None]
        for process in alive:
            _send(process.pid, sig, group=True)
        if sig != signal.SIGINT:
            for pid in rank_pids:
                _send(pid, sig, group=False)
        deadline = time.monotonic() + _STOP_GRACE_SECONDS
        for process in alive:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
        if all(process.poll() is not None for process in processes) and not any(map(_alive, rank_pids)):
            return


def _send(pid: int, sig: int, *, group: bool) -> None:
    """Signal a process (or its process group), ignoring one that has already gone."""
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _tails(logs: Sequence[Path]) -> str:
    """The last lines of each log, without TensorFlow's start-up chatter (cuda stubs, oneDNN)."""
    parts = []
    for log in logs:
        text = log.read_text(errors="replace") if log.exists() else ""
        lines = [line for line in text.splitlines() if not _TF_CHATTER.search(line)]
        parts.append(f"--- {log.name} (last {_LOG_TAIL_LINES} lines)\n" + "\n".join(lines[-_LOG_TAIL_LINES:]))
    return "\n".join(parts)


def run_rounds(
    groups: Sequence[str], config: WorkerConfig, rounds: int, timeout: float
) -> list[dict[str, GroupSummary]]:
    """`rounds` rounds, each running every group once in turn; a failed group is recorded, not fatal."""
    history = []
    for index in range(rounds):
        round_results = {}
        for group in groups:
            start = time.monotonic()
            try:
                round_results[group] = summarize(group, run_group(group, config, timeout))
            except GroupFailed as error:
                round_results[group] = GroupSummary(group=group, error=str(error))
                print(f"round {index + 1}: {error}", file=sys.stderr, flush=True)
            print(
                f"round {index + 1}/{rounds}: {group} done in {time.monotonic() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        history.append(round_results)
    return history


def report(results: Mapping[str, GroupSummary], sizes: Sequence[int], config: WorkerConfig, rounds: int) -> str:
    """Everything printed at the end: the tables, the targets and the checks."""
    header = (
        f"{WORLD_SIZE} processes per group on this machine, float32 sum, median over {config.repeats} repeats "
        f"of the slowest rank, then median over {rounds} round(s); per-rank batch {config.batch}; "
        f"gradient buckets {'default' if config.bucket_bytes is None else format_size(config.bucket_bytes)}"
    )
    parts = [
        header,
        "",
        "All-reduce of a TF tensor (speedups: MWMS time / ours, eager)",
        allreduce_table(results, sizes),
    ]
    if any(group in results for group in ("mpi", "grpc")):
        title = "Our all-reduce: communicator on numpy vs collectives.strategies.allreduce on a tensor"
        parts += ["", title, breakdown_table(results, sizes)]
    parts += [
        "",
        f"Training step of examples/train_keras.py's model (batch {config.batch} per rank)",
        train_table(results),
    ]
    checks = [f"{group}: {summary.wrong} wrong elements" for group, summary in results.items() if summary.error is None]
    failed = [f"{group}: FAILED in every round" for group, summary in results.items() if summary.error is not None]
    parts += ["", "Checks: " + "; ".join(checks + failed), "", "Targets:", *targets(results, sizes)]
    return "\n".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m collectives.bench.tf_compare", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=parse_sizes(DEFAULT_SIZES),
        help=f"bytes, comma-separated (default {DEFAULT_SIZES})",
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed iterations per size and per training variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations before each series")
    parser.add_argument("--batch", type=int, default=64, help="per-rank training batch (the example's default)")
    parser.add_argument(
        "--bucket-kib",
        type=int,
        default=None,
        help="DistributedGradientTape bucket size in KiB (default: the library's)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="times every group runs, alternating")
    parser.add_argument("--groups", type=parse_groups, default=GROUPS, help="some of mwms,mpi,grpc (default all)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one group may take")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure, per round, here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if importlib.util.find_spec("tensorflow") is None:
        print("collectives.bench.tf_compare needs TensorFlow: pip install -e '.[tf]'", file=sys.stderr)
        return 2
    for name in ("repeats", "rounds", "batch", "bucket_kib"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            print(f"collectives.bench.tf_compare: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    bucket_bytes = None if args.bucket_kib is None else args.bucket_kib << 10
    config = WorkerConfig(
        sizes=args.sizes, repeats=args.repeats, warmup=max(args.warmup, 0), batch=args.batch, bucket_bytes=bucket_bytes
    )
    history = run_rounds(args.groups, config, args.rounds, args.timeout)
    results = {group: combine([round_results[group] for round_results in history]) for group in args.groups}
    print(report(results, args.sizes, config, args.rounds))
    if args.json is not None:
        document = {
            "config": asdict(config),
            "rounds": [{group: asdict(summary) for group, summary in r.items()} for r in history],
            "median": {group: asdict(summary) for group, summary in results.items()},
            "targets": targets(results, args.sizes),
        }
        args.json.write_text(json.dumps(document, indent=1))
    return 0 if all(summary.error is None for summary in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
