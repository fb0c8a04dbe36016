"""Starting a job with `python -m collectives.launch` from a test, bounded in time.

The launcher puts every rank in a process group of its own and stops them all when it is
terminated; so a launch that outlives its limit is sent SIGTERM first (the launcher stops its
ranks), and only if it is still there a few seconds later SIGKILLed with its process group.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import pytest

LAUNCH_TIMEOUT = 120.0
STOP_SECONDS = 10.0

needs_grpc = pytest.mark.skipif(importlib.util.find_spec("grpc") is None, reason="grpcio not installed (.[grpc])")


def launch_job(
    launcher_args: list[str], *, timeout: float = LAUNCH_TIMEOUT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m collectives.launch ARGS`; its stdout and stderr apart; fail the test on a hang."""
    command = [sys.executable, "-m", "collectives.launch", *launcher_args]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            stdout, stderr = process.communicate(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(command)} still running after {timeout:g} s; stopped. Output:\n{stdout}{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
