"""COLLECTIVES_LOG_LEVEL: rank-prefixed lines; INFO says the backend, topology and each new choice
of `auto` once; DEBUG every collective; nothing at the default level."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import test_launch

from collectives import logs

JOB = """
import numpy as np
import collectives

comm = collectives.init()
for size in (1000, 1000, 1024, 3 << 20):
    comm.allreduce(np.ones(size // 4, dtype=np.float32))
comm.close()
"""


def _launch_with_level(tmp_path: Path, level: str | None, monkeypatch: pytest.MonkeyPatch) -> str:
    if level is None:
        monkeypatch.delenv(logs.ENV_LOG_LEVEL, raising=False)
    else:
        monkeypatch.setenv(logs.ENV_LOG_LEVEL, level)
    result = test_launch.launch(tmp_path, JOB, "-n", "2", "--backend", "grpc")
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_info_names_backend_topology_and_each_choice_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    output = _launch_with_level(tmp_path, "info", monkeypatch)
    for rank in range(2):
        lines = [line for line in output.splitlines() if f"[rank {rank}] collectives INFO" in line]
        assert any(f"rank {rank} of 2" in line and "backend grpc" in line for line in lines), output
        assert any("node(s):" in line and "ranks [0, 1]" in line for line in lines), output
        choices = [line for line in lines if "auto: all-reduce" in line]
        # 1000 and 1024 bytes share a size class (and an algorithm); 3 MiB is another class
        assert [re.search(r"2\^(\d+)", line).group(1) for line in choices] == ["10", "22"], output
    assert "DEBUG" not in output


def test_debug_shows_every_collective(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    output = _launch_with_level(tmp_path, "DEBUG", monkeypatch)
    for rank in range(2):
        calls = [line for line in output.splitlines() if f"[rank {rank}] collectives DEBUG rank {rank}: #" in line]
        assert sum("allreduce" in line for line in calls) == 4, output


def test_default_prints_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    output = _launch_with_level(tmp_path, None, monkeypatch)
    assert "collectives INFO" not in output and "collectives DEBUG" not in output, output


@pytest.mark.parametrize(("text", "level"), [("debug", logging.DEBUG), ("Warning", logging.WARNING), ("15", 15)])
def test_levels_are_parsed_like_logging(text: str, level: int) -> None:
    assert logs.parse_level(text) == level


def test_unknown_level_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="COLLECTIVES_LOG_LEVEL='loud' is not a logging level"):
        logs.parse_level("loud")
