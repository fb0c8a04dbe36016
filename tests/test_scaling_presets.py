"""The scaling model's published-cluster presets and its parameter-server curves.

Model computations only (deterministic, no ranks started): the presets reproduce the published
TensorFlow 1.1 efficiencies from hardware figures, `--preset --json` writes the documented shape,
and the parameter-server curves report the best number of servers from their sweep.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collectives.bench.commands import main
from collectives.bench.scaling import (
    ETHERNET_NODES,
    GPU_NODES,
    P2_XLARGE,
    PIZ_DAINT,
    PRESET_GPU_COUNTS,
    PRESETS,
    TrainingModel,
    parameter_server_curve,
    preset_points,
    server_counts,
    tf_parameter_server_exposed,
)


@pytest.mark.parametrize("preset", [PIZ_DAINT, P2_XLARGE], ids=lambda preset: preset.name)
def test_the_presets_reproduce_the_published_table_within_8_points(preset) -> None:
    """Piz Daint and p2.xlarge at 8, 64 and 128 GPUs: the model's parameter servers at their best S
    within 8 percentage points of the published TensorFlow 1.1 efficiencies."""
    modelled = {
        point.ranks: point.efficiency for point in preset_points(preset) if point.algorithm == "parameter_server"
    }
    assert {gpus for gpus, _ in preset.published} == {8, 64, 128}
    for gpus, published in preset.published:
        assert modelled[gpus] == pytest.approx(published, abs=0.08), gpus


def test_every_preset_has_its_points_and_the_ring_beats_tensorflows_servers() -> None:
    for preset in PRESETS.values():
        points = preset_points(preset)
        assert sorted((p.algorithm, p.ranks) for p in points) == sorted(
            (algorithm, gpus)
            for algorithm in ("parameter_server", "ring", "hierarchical")
            for gpus in PRESET_GPU_COUNTS
        )
        assert all(0 < p.efficiency <= 1 for p in points)
        by_key = {(p.algorithm, p.ranks): p.efficiency for p in points}
        assert all(by_key["ring", gpus] >= by_key["parameter_server", gpus] for gpus in PRESET_GPU_COUNTS)


def test_more_servers_help_until_the_largest_variable_is_alone() -> None:
    """Servers hold whole variables: beyond gradient / largest variable (12 for InceptionV3) a
    busiest server serves the logits kernel alone, and more servers change nothing."""
    model = PIZ_DAINT.training()
    exposed = [tf_parameter_server_exposed(PIZ_DAINT, 64, servers, model) for servers in range(1, 65)]
    assert all(later <= earlier for earlier, later in zip(exposed, exposed[1:]))
    assert exposed[11] == exposed[-1] < exposed[10]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_json_has_one_point_per_gpu_count_and_algorithm(name: str, tmp_path: Path) -> None:
    path = tmp_path / "points.json"
    assert main(["scaling", "--preset", name, "--json", str(path)]) == 0
    written = json.loads(path.read_text())
    assert set(written) == {"preset", "points"} and written["preset"] == name
    keys = [(point["gpus"], point["algorithm"]) for point in written["points"]]
    assert len(keys) == len(set(keys)) == 3 * len(PRESET_GPU_COUNTS)
    assert {gpus for gpus, _ in keys} == set(PRESET_GPU_COUNTS)
    for point in written["points"]:
        assert isinstance(point["efficiency"], float) and 0 < point["efficiency"] <= 1
        if point["algorithm"] == "parameter_server":
            assert set(point) == {"gpus", "algorithm", "num_servers", "efficiency"}
            assert 1 <= point["num_servers"] <= point["gpus"]
        else:
            assert set(point) == {"gpus", "algorithm", "efficiency"}


def test_preset_table_prints_published_beside_modelled(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scaling", "--preset", "all"]) == 0
    out = capsys.readouterr().out
    assert all(f"# {name}:" in out for name in PRESETS)
    assert "80.5%" in out and "27.6%" in out  # Piz Daint at 64, p2.xlarge at 128, as published


def test_json_needs_one_preset(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["scaling", "--preset", "all", "--json", str(tmp_path / "x.json")]) == 2
    assert main(["scaling", "--json", str(tmp_path / "x.json")]) == 2
    assert "--json" in capsys.readouterr().err


@pytest.mark.parametrize("kind", [GPU_NODES, ETHERNET_NODES], ids=lambda kind: kind.name)
def test_parameter_server_curve_reports_the_best_s_of_its_sweep(kind) -> None:
    points = parameter_server_curve(kind, TrainingModel(), [8, 64])
    assert [point.ranks for point in points] == [8, 64]
    for point in points:
        assert point.algorithm == "parameter_server" and point.num_servers in server_counts(point.ranks)
        assert 0 < point.efficiency <= 1


def test_server_counts_are_powers_of_two_and_every_rank() -> None:
    assert server_counts(8) == [1, 2, 4, 8]
    assert server_counts(12) == [1, 2, 4, 8, 12]
