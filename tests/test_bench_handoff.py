"""The rows rank 0 hands back to `python -m bench` survive the trip, explanations included."""

from __future__ import annotations

from pathlib import Path

import collectives
from bench.handoff import read_rows, write_rows
from bench.measure import Measurement


def test_explained_rows_round_trip(tmp_path: Path) -> None:
    """`--explain` rows (a measurement and the model's explanation) come back equal, as do plain ones."""
    explanation = collectives.run_threads(lambda comm: comm.explain(1 << 20), 4, ranks_per_node=2)[0]
    row = Measurement(nbytes=1 << 20, count=1 << 18, dtype="float32", op="sum", algorithm="ring", seconds=0.01, ranks=4, wrong=0)
    path = str(tmp_path / "rows.json")
    write_rows(path, [(row, explanation), row])
    assert read_rows(path) == [(row, explanation), row]
