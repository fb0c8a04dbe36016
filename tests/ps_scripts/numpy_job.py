"""One task of a TF_CONFIG job with ``ps`` tasks, in plain numpy; run by tests/test_ps_tasks.py.

Every task runs this script with its own TF_CONFIG. On a ps task `collectives.init()` serves and
exits the process; on a worker it returns the workers' communicator, and the scenario runs:

    numpy_job.py allreduce          parameter-server all-reduces of uneven sizes, dtypes and ops,
                                    checked against a float64 reference and compared across workers
    numpy_job.py loop MARKER_DIR    all-reduces until one fails (after the first few, writes
                                    MARKER_DIR/ready-RANK so that the test can kill a task)
    numpy_job.py disagree           worker r all-reduces 10 + r items: the ps task must refuse
    numpy_job.py crash              worker 1 ends with an uncaught exception after one all-reduce,
                                    worker 0 goes on all-reducing until that fails
    numpy_job.py idle SECONDS       one all-reduce, a pause of SECONDS, another (which fails where
                                    the ps task's idle timeout is shorter)

Each worker prints one JSON line: {"rank", "size", ...} with what it checked, or for `loop` the
error that ended it ({"error", "message", "at": time.time() when it was raised}).
Environment: WORKER_TIMEOUT (seconds per collective, default 30).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import collectives
from collectives.ps_tasks import ParameterServerJob, job_for

CASES = [  # (count, dtype, op): uneven sizes, none a multiple of the segment or of the workers
    (0, np.float32, "sum"),
    (1, np.float64, "sum"),
    (7, np.float32, "mean"),
    (1001, np.float64, "max"),
    (65_537, np.float32, "sum"),
    (300_001, np.float64, "min"),
    (12_345, np.int64, "sum"),
    (4_099, np.float32, "prod"),
]
LOOP_SECONDS = 120.0
"""The `loop` scenario gives up (exit 3) when nothing failed in this long."""


def contribution(rank: int, count: int, dtype: type | str) -> np.ndarray:
    """Worker `rank`'s input: any worker can make any other's, for the reference."""
    rng = np.random.default_rng([rank, count])
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, count).astype(dtype)
    return rng.uniform(0.5, 1.5, count).astype(dtype)


def reference(workers: int, count: int, dtype: type | str, op: str) -> np.ndarray:
    """The reduction in float64 over every worker's input."""
    inputs = np.stack([contribution(rank, count, dtype).astype(np.float64) for rank in range(workers)])
    return np.asarray(getattr(np, op)(inputs, axis=0))  # np.sum, np.mean, np.max, np.min, np.prod


def servers(comm: collectives.Communicator) -> ParameterServerJob:
    job = job_for(comm, "parameter_server")
    if job is None:
        raise AssertionError("no ps tasks found for the workers' communicator")
    return job


def check_allreduces(comm: collectives.Communicator) -> dict:
    job = servers(comm)
    digest = hashlib.sha256()
    for count, dtype, op in CASES:
        got = job.allreduce_async(contribution(comm.rank, count, dtype), op).wait()
        want = reference(comm.size, count, dtype, op)
        if got.dtype != np.dtype(dtype) or got.shape != (count,):
            raise AssertionError(f"{count} {dtype} {op}: got {got.dtype} {got.shape}")
        tolerance = 1e-6 if np.dtype(dtype) == np.float32 else 1e-12
        np.testing.assert_allclose(got, want, rtol=tolerance, err_msg=f"{count} {np.dtype(dtype)} {op}")
        digest.update(got.tobytes())
    digests = comm.allgather(np.frombuffer(digest.digest(), np.uint8)).reshape(comm.size, -1)
    if not (digests == digests[0]).all():
        raise AssertionError("the workers' results are not bit-identical")
    return {"cases": len(CASES), "servers": job.describe_servers(), "world": job.world.size}


def loop_until_error(comm: collectives.Communicator, markers: Path) -> dict:
    job = servers(comm)
    x = np.ones(10_000, np.float32)
    started = time.monotonic()
    rounds = 0
    while time.monotonic() - started < LOOP_SECONDS:
        try:
            job.allreduce_async(x).wait()
        except collectives.CollectiveError as error:
            return {"error": type(error).__name__, "message": str(error), "at": time.time(), "rounds": rounds}
        rounds += 1
        if rounds == 3:
            (markers / f"ready-{comm.rank}").touch()
        time.sleep(0.02)
    print(json.dumps({"rank": comm.rank, "error": None}), flush=True)
    sys.exit(3)


def failure(comm: collectives.Communicator, count: int) -> dict:
    """The error of an all-reduce of `count` items on the servers (None if it succeeded)."""
    try:
        servers(comm).allreduce_async(np.ones(count, np.float32)).wait()
    except collectives.CollectiveError as error:
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None}


def crash(comm: collectives.Communicator) -> dict:
    failure(comm, 100)
    if comm.rank == 1:
        raise RuntimeError("worker 1 fails on purpose")
    while (outcome := failure(comm, 100))["error"] is None:
        time.sleep(0.02)
    return outcome


def main() -> None:
    comm = collectives.init(timeout=float(os.environ.get("WORKER_TIMEOUT", "30")))
    scenario = sys.argv[1]
    if scenario == "allreduce":
        outcome = check_allreduces(comm)
    elif scenario == "disagree":
        outcome = failure(comm, 10 + comm.rank)
    elif scenario == "crash":
        outcome = crash(comm)
    elif scenario == "idle":
        failure(comm, 100)
        time.sleep(float(sys.argv[2]))
        outcome = failure(comm, 100)
    else:
        outcome = loop_until_error(comm, Path(sys.argv[2]))
    print(json.dumps({"rank": comm.rank, "size": comm.size, **outcome}), flush=True)
    if scenario == "allreduce":
        comm.close()


if __name__ == "__main__":
    main()
