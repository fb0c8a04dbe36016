"""The shared collective bodies (`bodies.py`) over the threads backend.

The same bodies run over MPI and gRPC in real processes (test_mpi.py, test_grpc.py).
"""

from __future__ import annotations

import pytest
from bodies import AUTOTUNE, BODIES

import collectives


@pytest.mark.parametrize("name", sorted(BODIES))
@pytest.mark.parametrize(("world_size", "ranks_per_node"), [(2, None), (4, 2), (3, [2, 1])])
def test_body_on_threads(name: str, world_size: int, ranks_per_node) -> None:
    """Each body passes on every rank of an in-process world."""
    autotune = AUTOTUNE.get(name, False)
    collectives.run_threads(BODIES[name], world_size, ranks_per_node=ranks_per_node, timeout=30, autotune=autotune)
