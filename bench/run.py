"""Where a sweep runs: thread ranks in this process, or real processes started for the user.

On the threads backend every rank is a thread here and rank 0's result is returned directly. On
MPI and gRPC the ranks are processes: this process re-launches `python -m bench` with the same
arguments through `python -m collectives.launch`, each rank measures, and rank 0 writes its result
to a file named by the hidden `--worker-output` option, which the parent reads back. All ranks
compute the same result (every time is all-reduced), so rank 0's is the run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

from collectives import Communicator, run_threads
from collectives.backends.device import use_local_device

from .measure import SweepResult, SweepSpec, measure, progress_steps
from .output import describe_link_costs, result_from_dict, to_dict
from .progress import ProgressBar


def rank_sweep(
    spec: SweepSpec, *, tune: bool = False, probe: bool = False, progress: bool | None = None
) -> Callable[[Communicator], SweepResult]:
    """What each rank runs: a tune, a probe, or else (for all-reduce) the quick calibration that
    `collectives.init()` runs by default; the measurement; then auto's choices.

    `progress`: draw a bar on rank 0's stderr (None: only if stderr is a terminal).
    """

    def sweep(comm: Communicator) -> SweepResult:
        if tune:
            comm.tune()
        elif probe:
            comm.probe()
        elif spec.collective == "allreduce":
            comm.calibrate()
        with ProgressBar(progress_steps(spec), enabled=False if comm.rank else progress) as bar:
            rows = measure(comm, spec, bar.advance)
        choices: dict[int, str] = {}
        predicted: dict[int, dict[str, float]] = {}
        if spec.collective == "allreduce":
            for nbytes in sorted({row.nbytes for row in rows}):
                explanation = comm.explain(nbytes, spec.dtype)
                choices[nbytes] = explanation.choice
                predicted[nbytes] = dict(explanation.corrected)
        costs = describe_link_costs(comm.link_costs) if spec.collective == "allreduce" else ""
        return SweepResult(rows, choices, predicted, costs)

    return sweep


def on_threads(
    sweep: Callable[[Communicator], SweepResult], ranks: int, ranks_per_node: int | Sequence[int] | None
) -> SweepResult:
    """Run `sweep` on `ranks` thread ranks of this process."""
    return run_threads(sweep, ranks, ranks_per_node=ranks_per_node)[0]


def as_launched_rank(sweep: Callable[[Communicator], SweepResult], output_path: str, device: str) -> int:
    """Inside a launched job: measure on this rank (on the GPU of its local rank, for device
    buffers); rank 0 writes the result for the parent."""
    import collectives

    comm = collectives.init(autotune="off")  # the sweep tunes, probes or calibrates as asked
    if device == "cuda":
        use_local_device()
    result = sweep(comm)
    if comm.rank == 0:
        with open(output_path, "w") as output:
            json.dump(to_dict(result), output)
    comm.close()
    return 0


def in_processes(backend: str, ranks: int, ranks_per_node: int | None, argv: Sequence[str]) -> SweepResult | None:
    """Start `ranks` processes of `python -m bench argv` through the launcher; rank 0's result.

    Returns None (after printing the ranks' output to stderr) if the job failed.
    """
    with tempfile.TemporaryDirectory() as scratch:
        output_path = os.path.join(scratch, "result.json")
        command = [sys.executable, "-m", "collectives.launch", "-n", str(ranks), "--backend", backend]
        if ranks_per_node:
            command += ["--ranks-per-node", str(ranks_per_node)]
        command += ["-m", "collectives.bench", *argv, "--worker-output", output_path]
        finished = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if finished.returncode != 0 or not os.path.exists(output_path):
            print(f"the {backend} ranks failed (exit code {finished.returncode}):\n{finished.stdout}", file=sys.stderr)
            return None
        with open(output_path) as stream:
            return result_from_dict(json.load(stream))
