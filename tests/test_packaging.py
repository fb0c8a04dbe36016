"""The wheel installs one top-level package, `collectives`, that works beside a user's own modules.

The repository's folders `backends/`, `strategies/` and `bench/` install as sub-packages of
`collectives` (setuptools package-dir). Were they top-level packages, a training project with its
own `backends/` package would break `import collectives` (`No module named 'backends.errors'`) and
its own `strategies.py` would silently stand in for the TensorFlow integration. So: build the
wheel from this checkout, read its file list, install it into a fresh virtual environment and use
it from inside such a project.

The build uses the running environment's setuptools without build isolation (no network). It
runs on a copy of the sources: setuptools builds in place, leaving `build/` and `*.egg-info` in
the tree, and files deleted since an earlier build would linger in `build/lib` and ship again.
The fresh environment sees numpy and numba (and nothing else of the running environment's
packages, unless they share a folder) through a `.pth` file, so the test's own editable install of
`collectives` cannot stand in for the wheel.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numba
import numpy as np
import pytest

REPOSITORY = Path(__file__).resolve().parents[1]

PACKAGE_FOLDERS = {
    "collectives": "collectives",
    "backends": "collectives/backends",
    "strategies": "collectives/strategies",
    "bench": "collectives/bench",
    "examples": "collectives/examples",
}
"""Each source folder and where its files land in the wheel."""

SUB_PACKAGES = ("backends", "strategies", "bench", "core", "algorithms", "selection")

NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", ".benchmarks"
)
"""What a copy of the checkout leaves out: environments, build outputs and caches."""

BUILD_TIMEOUT = 180
STEP_TIMEOUT = 120
"""Seconds for each other subprocess: making the environment, installing, running the checks."""

WORLD_SIZE = 3
COUNT = 7


def run(command: list[str], timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `command` to completion within `timeout` seconds; fail the test with its output otherwise.

    PYTHONPATH and friends are dropped so that nothing but the fresh environment's own site
    decides what it imports (PYTHONSAFEPATH would also hide the working directory)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}
    env["PYTHONNOUSERSITE"] = "1"
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(command)} exited with {result.returncode}\n{result.stdout}\n{result.stderr}"
    )
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of this checkout."""
    sources = tmp_path_factory.mktemp("sources") / "collectives"
    shutil.copytree(REPOSITORY, sources, symlinks=True, ignore=NOT_SOURCES)
    out = tmp_path_factory.mktemp("wheel")
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out)]
        + [str(sources)],
        BUILD_TIMEOUT,
    )
    (built,) = out.glob("collectives-*.whl")
    return built


def test_the_wheel_ships_every_module_under_collectives_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = {name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info")}
        assert len(dist_info) == 1, dist_info
        (metadata,) = dist_info
        top_level = archive.read(f"{metadata}/top_level.txt").decode() if f"{metadata}/top_level.txt" in names else ""
        entry_points = archive.read(f"{metadata}/entry_points.txt").decode()

    assert {name.split("/")[0] for name in names} == {"collectives", metadata}
    assert top_level.split() in ([], ["collectives"]), top_level
    expected = {
        f"{target}/{path.relative_to(REPOSITORY / folder).as_posix()}"
        for folder, target in PACKAGE_FOLDERS.items()
        for path in (REPOSITORY / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert sorted(expected - names) == []
    assert {f"collectives/{sub}/__init__.py" for sub in SUB_PACKAGES} <= names
    assert "collectives/py.typed" in names
    scripts = [line.split("=", 1)[1].strip() for line in entry_points.splitlines() if "=" in line]
    assert scripts and all(target.startswith("collectives.") for target in scripts), entry_points


USER_CHECK = """
import json
import sys

import numpy as np

import backends
import strategies
import collectives

facts = {"backends": backends.__file__, "strategies": strategies.__file__, "collectives": collectives.__file__}
world, count = int(sys.argv[1]), int(sys.argv[2])


def contribute(comm):
    return comm.allreduce(np.arange(count, dtype=np.float32) + comm.rank)


facts["allreduce"] = [[result.dtype.name, result.tolist()] for result in collectives.run_threads(contribute, world)]
try:
    import collectives.strategies
except ImportError:  # TensorFlow needed after all (e.g. not installed): nothing to compare
    facts["collectives.strategies"] = None
else:
    facts["collectives.strategies"] = collectives.strategies.__file__
facts["imported tensorflow"] = "tensorflow" in sys.modules
print(json.dumps(facts))
"""
"""Run in the user's project: whose modules each import name finds, and an all-reduce on threads."""


def make_user_project(root: Path) -> Path:
    """A training project with its own `backends` package (no `errors` module) and `strategies.py`."""
    project = root / "project"
    (project / "backends").mkdir(parents=True)
    (project / "backends" / "__init__.py").write_text('"""The project\'s own backends."""\n')
    (project / "strategies.py").write_text('"""The project\'s own strategies."""\n')
    (project / "check.py").write_text(textwrap.dedent(USER_CHECK))
    return project


def fresh_environment(root: Path) -> tuple[Path, Path]:
    """A new virtual environment that sees numpy and numba from the running one: (python, site-packages)."""
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], STEP_TIMEOUT)
    python = venv / "bin" / "python"
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], STEP_TIMEOUT)
    site_packages = Path(purelib.stdout.strip())
    dependencies = {str(Path(inspect.getfile(module)).parents[1]) for module in (np, numba)}
    (site_packages / "dependencies.pth").write_text("".join(f"{folder}\n" for folder in sorted(dependencies)))
    return python, site_packages


def test_the_wheel_works_beside_a_project_with_its_own_backends_and_strategies(wheel: Path, tmp_path: Path) -> None:
    python, site_packages = fresh_environment(tmp_path)
    run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site_packages), str(wheel)],
        STEP_TIMEOUT,
    )
    project = make_user_project(tmp_path)

    checked = run([str(python), "check.py", str(WORLD_SIZE), str(COUNT)], STEP_TIMEOUT, cwd=project)
    facts = json.loads(checked.stdout.splitlines()[-1])
    installed = site_packages / "collectives"
    assert Path(facts["backends"]).samefile(project / "backends" / "__init__.py"), facts
    assert Path(facts["strategies"]).samefile(project / "strategies.py"), facts
    assert Path(facts["collectives"]).samefile(installed / "__init__.py"), f"not the wheel's: {facts}"
    expected = (np.arange(COUNT, dtype=np.float32) * WORLD_SIZE + sum(range(WORLD_SIZE))).tolist()
    assert facts["allreduce"] == [["float32", expected]] * WORLD_SIZE
    if facts["collectives.strategies"] is not None:
        assert Path(facts["collectives.strategies"]).samefile(installed / "strategies" / "__init__.py"), facts
        assert not facts["imported tensorflow"], "importing collectives.strategies imported TensorFlow"

    bench_help = run([str(python), "-m", "collectives.bench", "--help"], STEP_TIMEOUT, cwd=project)
    assert bench_help.stdout.startswith("usage:"), bench_help.stdout
