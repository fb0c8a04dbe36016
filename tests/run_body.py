"""Run named bodies from `bodies.py` on this process's communicator: `python run_body.py NAME...`.

Started by the multi-process tests under `mpiexec` or `python -m collectives.launch`; exits
non-zero with the traceback on the first failing body.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bodies import BODIES  # noqa: E402

import collectives  # noqa: E402


def main(names: list[str]) -> int:
    comm = collectives.init(timeout=30)
    for name in names:
        BODIES[name](comm)
        print(f"rank {comm.rank}: {name} ok", flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
