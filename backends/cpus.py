"""How much CPU this process may use: the cores its affinity allows and its cgroup's CPU quota.

A container limited with `--cpus=2` (Docker) or a CPU limit (Kubernetes) still sees every core of
the host in its affinity mask; only its cgroup's CFS quota says that it gets two cores' worth of
time per period. Waits that spin (`backends.mpi`) and worker pools (`selection.simulation`) size
themselves by what is really there, as the JVM and Go's runtime do in containers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where cgroup file systems are mounted (v2 unified at the root, v1 one folder per controller)."""


class CpuShare(NamedTuple):
    """What one process may use: its cores, its cgroup (the text of /proc/self/cgroup: processes
    in one cgroup share its quota) and that quota in cores (inf where there is none)."""

    cores: frozenset[int]
    cgroup: str
    quota: float


def usable_cores() -> frozenset[int]:
    """The cores this process may run on (all of them where the platform cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def cpu_quota(cgroup_listing: str, root: Path = CGROUP_ROOT) -> float:
    """Cores' worth of CPU time per period that the cgroup of `cgroup_listing` (the text of
    /proc/self/cgroup) and the cgroups above it allow, the tightest of them; inf where none sets a
    quota or none can be read. cgroup v2 keeps it in `cpu.max` ("max 100000" or "QUOTA PERIOD"),
    v1 in `cpu.cfs_quota_us` (-1: none) beside `cpu.cfs_period_us`."""
    tightest = math.inf
    for line in cgroup_listing.splitlines():
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and controllers == "":
            for folder in _up_from(root, path):
                tightest = min(tightest, _quota_v2(folder / "cpu.max"))
        elif "cpu" in controllers.split(","):
            mount = root / controllers
            if not mount.is_dir():
                mount = root / "cpu"
            for folder in _up_from(mount, path):
                tightest = min(tightest, _quota_v1(folder))
    return tightest


def cpu_share() -> CpuShare:
    """This process's `CpuShare`."""
    try:
        listing = Path("/proc/self/cgroup").read_text()
    except OSError:
        listing = ""
    return CpuShare(usable_cores(), listing, cpu_quota(listing))


def usable_cpus() -> int:
    """Whole cores this process may keep busy: its affinity's, capped by its cgroup's quota (at
    least 1)."""
    share = cpu_share()
    return max(1, int(min(len(share.cores), share.quota)))


def crowded(shares: Iterable[CpuShare]) -> bool:
    """Whether processes with these shares (those of one node) outnumber the cores they may run on:
    all of them together, or those of one cgroup its quota."""
    everyone = list(shares)
    by_cgroup: dict[str, list[CpuShare]] = {}
    for share in everyone:
        by_cgroup.setdefault(share.cgroup, []).append(share)
    return _outnumber(everyone, math.inf) or any(
        _outnumber(group, min(share.quota for share in group)) for group in by_cgroup.values()
    )


def _outnumber(shares: list[CpuShare], quota: float) -> bool:
    """Whether `shares` are more than the cores in their affinities together, or than `quota`."""
    return len(shares) > min(len(frozenset().union(*(share.cores for share in shares))), quota)


def _up_from(mount: Path, path: str) -> list[Path]:
    """`mount`/`path` and every folder above it up to `mount`, deepest first."""
    parts = [part for part in path.split("/") if part]
    return [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _quota_v2(cpu_max: Path) -> float:
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return math.inf if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return math.inf


def _quota_v1(folder: Path) -> float:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return math.inf
    return math.inf if quota < 0 or period <= 0 else quota / period
