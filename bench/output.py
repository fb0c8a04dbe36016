"""How results leave the benchmark: the nccl-tests table on stdout, CSV and JSON files.

The table is for reading now; CSV and JSON are for comparing later (another commit, another
machine, another backend), so they hold one row per (size, algorithm, placement) with every field,
and the JSON file also records how the run was made and on what: the parameters, the library and
dependency versions, the host, the time and the load average (on a shared machine the load is the
first thing to check when two runs disagree). Both read back into `Measurement`s.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os
import platform
import socket
import sys
import typing
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from collectives.core.topology import LinkCosts

from .measure import COPY_BOUND, IN_PLACE, OUT_OF_PLACE, Measurement, SweepResult

_FIELDS = [f.name for f in dataclasses.fields(Measurement)]
_DERIVED = ["algbw", "busbw", "auto_choice"]


def _algorithm_label(row: Measurement, choices: Mapping[int, str]) -> str:
    choice = choices.get(row.nbytes)
    return f"auto->{choice}" if row.algorithm == "auto" and choice else row.algorithm


def format_table(result: SweepResult) -> str:
    """nccl-tests' columns, out-of-place then in-place on one line per (size, algorithm).

    `auto->ring` names what auto picked at that size; `copy-bound` has no in-place column.
    """
    cells = {(r.nbytes, r.algorithm, r.placement): r for r in result.rows}
    keys = list(dict.fromkeys((r.nbytes, r.algorithm) for r in result.rows))
    placement_header = f" {'time(us)':>11} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6}"
    columns = f"{'size':>11} {'count':>11} {'type':>8} {'redop':>5} {'root':>4} {'algorithm':>18}"
    width = len(placement_header)
    lines = [
        f"{'':>{len(columns)}}{OUT_OF_PLACE:^{width}}{IN_PLACE:^{width}}".rstrip(),
        columns + placement_header * 2,
    ]
    for nbytes, algorithm in keys:
        first = cells.get((nbytes, algorithm, OUT_OF_PLACE)) or cells[nbytes, algorithm, IN_PLACE]
        line = (
            f"{first.nbytes:>11} {first.count:>11} {first.dtype:>8} {first.op:>5} {first.root:>4} "
            f"{_algorithm_label(first, result.choices):>18}"
        )
        for placement in (OUT_OF_PLACE, IN_PLACE):
            row = cells.get((nbytes, algorithm, placement))
            if row is None:
                line += f" {'-':>11} {'-':>11} {'-':>11} {'-':>6}"
            else:
                line += f" {row.seconds * 1e6:>11.1f} {row.algbw / 1e9:>11.3f} {row.busbw / 1e9:>11.3f} {row.wrong:>6}"
        lines.append(line)
    return "\n".join(lines)


def format_explained(result: SweepResult) -> str:
    """Measured out-of-place time beside the model's (tuned, if tuned) prediction; `*` marks auto's
    pick, and auto's row says how far it is from the fastest of its candidates measured at that
    size (the algorithms the model predicted: `native` where the backend has it, never `raw`)."""
    rows = [r for r in result.rows if r.placement == OUT_OF_PLACE and r.algorithm != COPY_BOUND]
    lines = [
        f"{'size':>12} {'algorithm':>18} {'measured(us)':>13} {'model(us)':>11} {'auto':>18} {'#wrong':>7}  vs fastest"
    ]
    for row in rows:
        choice = result.choices.get(row.nbytes, "")
        candidates = result.predicted.get(row.nbytes, {})
        predicted = candidates.get(row.algorithm)
        model = f"{predicted * 1e6:>11.1f}" if predicted is not None else f"{'-':>11}"
        mark = choice if row.algorithm == "auto" else ("*" if row.algorithm == choice else "")
        line = f"{row.nbytes:>12} {row.algorithm:>18} {row.seconds * 1e6:>13.1f} {model} {mark:>18} {row.wrong:>7}"
        others = [r for r in rows if r.nbytes == row.nbytes and r.algorithm in candidates]
        if row.algorithm == "auto" and others:
            fastest = min(others, key=lambda r: r.seconds)
            line += f"  {row.seconds / fastest.seconds - 1:+.1%} ({fastest.algorithm})"
        lines.append(line)
    return "\n".join(lines)


def environment(backend: str) -> dict[str, Any]:
    """Where and when a run was made, and with which versions of what it depends on."""
    from collectives import __version__  # the code that ran, even from a source tree

    versions: dict[str, str | None] = {"python": platform.python_version(), "collectives": __version__}
    for package in ("numpy", "numba", {"mpi": "mpi4py", "grpc": "grpcio"}.get(backend)):
        if package:
            try:
                versions[package] = metadata.version(package)
            except metadata.PackageNotFoundError:
                versions[package] = None
    return {
        "hostname": socket.gethostname(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "argv": sys.argv,
        "versions": versions,
    }


def _record(row: Measurement, choices: Mapping[int, str]) -> dict[str, Any]:
    return {
        **dataclasses.asdict(row),
        "algbw": row.algbw,
        "busbw": row.busbw,
        "auto_choice": choices.get(row.nbytes, ""),
    }


def write_csv(path: str, result: SweepResult) -> None:
    """One line per (size, algorithm, placement): every `Measurement` field, algbw, busbw (B/s)."""
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=_FIELDS + _DERIVED)
        writer.writeheader()
        for row in result.rows:
            writer.writerow(_record(row, result.choices))


def read_csv(path: str) -> list[Measurement]:
    """The rows of a file written by `write_csv`, each field converted back to its annotated type
    (int, float or str); the derived columns are left out."""
    field_types = typing.get_type_hints(Measurement)
    with open(path, newline="") as stream:
        return [
            Measurement(**{k: field_types[k](v) for k, v in line.items() if k in field_types})
            for line in csv.DictReader(stream)
        ]


def write_json(path: str, result: SweepResult, parameters: Mapping[str, Any], backend: str) -> None:
    """The rows plus the run's parameters and environment, for comparing runs later."""
    document = {
        "parameters": dict(parameters),
        "environment": environment(backend),
        "auto_choice": {str(k): v for k, v in result.choices.items()},
        "model_seconds": {str(k): v for k, v in result.predicted.items()},
        "link_costs": result.link_costs,
        "rows": [_record(row, result.choices) for row in result.rows],
    }
    with open(path, "w") as stream:
        json.dump(document, stream, indent=1)
        stream.write("\n")


def read_json(path: str) -> tuple[list[Measurement], dict[str, Any]]:
    """(the rows, the whole document) of a file written by `write_json`."""
    with open(path) as stream:
        document = json.load(stream)
    return [Measurement(**{k: row[k] for k in _FIELDS}) for row in document["rows"]], document


def result_from_dict(document: Mapping[str, Any]) -> SweepResult:
    """Rebuild a `SweepResult` sent as JSON by a rank of a launched job (see `to_dict`)."""
    return SweepResult(
        rows=[Measurement(**row) for row in document["rows"]],
        choices={int(k): v for k, v in document["choices"].items()},
        predicted={int(k): v for k, v in document["predicted"].items()},
        link_costs=document.get("link_costs", ""),
    )


def to_dict(result: SweepResult) -> dict[str, Any]:
    """A JSON-ready form of `result` (rank 0 of a launched job hands it to the parent this way)."""
    return {
        "rows": [dataclasses.asdict(row) for row in result.rows],
        "choices": {str(k): v for k, v in result.choices.items()},
        "predicted": {str(k): v for k, v in result.predicted.items()},
        "link_costs": result.link_costs,
    }


def describe_link_costs(costs: LinkCosts) -> str:
    """What the selector believes about the links, e.g. to see that a probe found the slow one."""

    def gbit(beta: float) -> str:
        return f"{8 / beta / 1e9:.2f} Gbit/s" if beta > 0 else "unmeasurably fast"

    source = "probed" if costs.measured else "defaults, not probed (add --probe)"
    return (
        f"link costs ({source}): intra {costs.intra.alpha * 1e6:.0f} us {gbit(costs.intra.beta)}, "
        f"inter {costs.inter.alpha * 1e6:.0f} us {gbit(costs.inter.beta)}, NIC {gbit(costs.nic_beta)}"
    )
