"""What a process may use of the CPU: cgroup quotas (v1 and v2, nested) and crowded nodes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from collectives.backends import cpus
from collectives.backends.cpus import CpuShare, cpu_quota, crowded


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_quota_is_the_tightest_along_the_path(tmp_path: Path) -> None:
    _write(tmp_path, "cpu.max", "max 100000\n")
    _write(tmp_path, "kubepods/cpu.max", "400000 100000\n")
    _write(tmp_path, "kubepods/pod/cpu.max", "150000 100000\n")
    _write(tmp_path, "kubepods/pod/job/cpu.max", "max 100000\n")
    assert cpu_quota("0::/kubepods/pod/job\n", tmp_path) == 1.5
    assert cpu_quota("0::/kubepods\n", tmp_path) == 4.0


def test_v1_quota_in_a_combined_controller_folder(tmp_path: Path) -> None:
    _write(tmp_path, "cpu,cpuacct/docker/cpu.cfs_quota_us", "200000\n")
    _write(tmp_path, "cpu,cpuacct/docker/cpu.cfs_period_us", "100000\n")
    _write(tmp_path, "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    _write(tmp_path, "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    listing = "12:memory:/docker\n4:cpu,cpuacct:/docker\n0::/\n"
    assert cpu_quota(listing, tmp_path) == 2.0


def test_v1_container_sees_its_own_cgroup_at_the_mount(tmp_path: Path) -> None:
    """Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names the host's path,
    which does not exist inside, while the mount itself is the container's cgroup."""
    _write(tmp_path, "cpu/cpu.cfs_quota_us", "50000\n")
    _write(tmp_path, "cpu/cpu.cfs_period_us", "100000\n")
    assert cpu_quota("3:cpu:/docker/0123abcd\n", tmp_path) == 0.5


@pytest.mark.parametrize(
    "listing, files",
    [
        ("0::/\n", {}),  # the root cgroup has no cpu.max
        ("0::/job\n", {"job/cpu.max": "max 100000\n"}),
        ("0::/job\n", {"job/cpu.max": "garbled\n"}),
        ("4:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}),
        ("", {}),
    ],
)
def test_no_quota_reads_as_unlimited(tmp_path: Path, listing: str, files: dict[str, str]) -> None:
    for relative, text in files.items():
        _write(tmp_path, relative, text)
    assert cpu_quota(listing, tmp_path) == math.inf


def test_this_process_has_a_share() -> None:
    share = cpus.cpu_share()
    assert share.cores and share.quota > 0 and cpus.usable_cpus() >= 1


def _share(cores: range, cgroup: str = "0::/\n", quota: float = math.inf) -> CpuShare:
    return CpuShare(frozenset(cores), cgroup, quota)


def test_crowded_counts_the_cores_of_every_rank_together() -> None:
    assert not crowded([_share(range(0, 1)), _share(range(1, 2))])
    assert crowded([_share(range(0, 1)), _share(range(0, 1))])
    assert not crowded([_share(range(0, 4))] * 4)
    assert crowded([_share(range(0, 4))] * 5)


def test_crowded_caps_the_cores_by_the_quota_of_each_cgroup_once() -> None:
    """Four ranks of one container limited to 2 CPUs on a 64-core host are crowded; in two such
    containers, 2 ranks each, they are not."""
    one = _share(range(64), "0::/pod-a\n", 2.0)
    assert crowded([one] * 4)
    assert not crowded([one] * 2)
    other = _share(range(64), "0::/pod-b\n", 2.0)
    assert not crowded([one, one, other, other])
    assert crowded([one, one, one, other])  # 3 ranks on pod-a's 2 CPUs
