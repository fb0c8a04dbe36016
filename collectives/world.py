"""This process's place in the world of the last `collectives.init()`, as Horovod's `hvd.rank()`,
`hvd.local_rank()`, ... give it: scripts ported from Horovod call these without a communicator.

Each raises RuntimeError when `init()` has not been called in this process.
"""

from __future__ import annotations

from collectives.bootstrap import default_communicator


def rank() -> int:
    """This process's rank."""
    return default_communicator().rank


def size() -> int:
    """Number of ranks."""
    return default_communicator().size


def local_rank() -> int:
    """Position of this rank among the ranks of its node."""
    return default_communicator().local_rank


def local_size() -> int:
    """Number of ranks on this rank's node."""
    return default_communicator().local_size


def cross_rank() -> int:
    """Position of this rank among the ranks with its local rank (the node index on uniform nodes)."""
    return default_communicator().cross_rank


def cross_size() -> int:
    """Number of ranks with this rank's local rank (the number of nodes on uniform nodes)."""
    return default_communicator().cross_size
