"""How rank 0 of a benchmark run in processes hands its rows back to the process that started it.

The rows are `Measurement`s, or with `--explain` (`Measurement`, `Explanation`) pairs; both go
through one JSON file, so that `--explain` (the model's prediction and auto's choice) works on
every backend, not only on threads where the rows never leave the process.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence, Union

from collectives.selector import Explanation
from collectives.topology import LinkCost, LinkCosts

from .measure import Measurement

Row = Union[Measurement, tuple[Measurement, Explanation]]


def write_rows(path: str, rows: Sequence[Row]) -> None:
    """Write `rows` to `path` as JSON."""
    with open(path, "w") as output:
        json.dump([_encode(row) for row in rows], output)


def read_rows(path: str) -> list[Row]:
    """The rows `write_rows` wrote to `path`."""
    with open(path) as source:
        return [_decode(item) for item in json.load(source)]


def _encode(row: Row) -> dict[str, Any]:
    if isinstance(row, Measurement):
        return {"measurement": dataclasses.asdict(row)}
    measurement, explanation = row
    return {"measurement": dataclasses.asdict(measurement), "explanation": dataclasses.asdict(explanation)}


def _decode(item: dict[str, Any]) -> Row:
    measurement = Measurement(**item["measurement"])
    if "explanation" not in item:
        return measurement
    fields = item["explanation"]
    costs = fields["costs"]
    explanation = Explanation(
        nbytes=fields["nbytes"],
        predicted=fields["predicted"],
        corrected=fields["corrected"],
        choice=fields["choice"],
        costs=LinkCosts(
            intra=LinkCost(**costs["intra"]),
            inter=LinkCost(**costs["inter"]),
            nic_beta=costs["nic_beta"],
            gamma=costs["gamma"],
            measured=costs["measured"],
        ),
        tuned=fields["tuned"],
    )
    return measurement, explanation
