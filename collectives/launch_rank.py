"""`python -m collectives.launch_rank [-m] script [args...]`: one rank of an MPI job that
`collectives.launch` started, run as `python [-m] script args...` would run it, its output
line-buffered.

mpiexec labels a rank's output (`-prepend-rank`) piece by piece, as each write arrives, not line
by line. A rank whose output was unbuffered wrote every argument of a `print` apart, so its lines
reached the terminal cut up and mixed with other ranks' ("[0] 1048576[0]  [0] {'raw': ...");
written a whole line at a time, each line is labelled once. The gRPC launch reads every rank's
lines itself and needs none of this.
"""

from __future__ import annotations

import io
import os
import runpy
import sys
from collections.abc import Sequence
from types import TracebackType


def main(argv: Sequence[str]) -> None:
    """Run the script (or `-m` module) `argv` names with its arguments, as `__main__`."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit("usage: python -m collectives.launch_rank [-m] script [args...]")
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # where `python script` looks first
            runpy.run_path(argv[0], run_name="__main__")
    except Exception as error:  # reported as Python reports it, less the frames of this runner
        trace = _without_runner_frames(error.__traceback__)
        sys.excepthook(type(error), error.with_traceback(trace), trace)
        raise SystemExit(1) from None


def _without_runner_frames(trace: TracebackType | None) -> TracebackType | None:
    """`trace` from the first frame that is neither this module's nor runpy's: the script's."""
    while trace is not None and (
        trace.tb_frame.f_code.co_filename == __file__ or trace.tb_frame.f_globals.get("__name__") == "runpy"
    ):
        trace = trace.tb_next
    return trace


if __name__ == "__main__":
    main(sys.argv[1:])
