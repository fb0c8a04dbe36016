"""Dissemination barrier: in round k every rank signals rank + 2^k and waits for rank - 2^k.

After ceil(log2 p) rounds every rank has (transitively) heard from every other, so none leaves
before all have arrived. Messages are empty; only their arrival (and matching header) matters.

Cost: ceil(log2 p) alpha.
"""

from __future__ import annotations

import numpy as np

from collectives.core.group import Group
from collectives.core.schedule import Steps, wait_all

_EMPTY = np.empty(0, dtype=np.uint8)


def dissemination_barrier_steps(group: Group) -> Steps:
    """Finish on every member only after every member has entered.

    A step machine (`schedule`); `schedule.drive` runs it blocking. Talks on the first of the
    group's tags."""
    p, r = group.size, group.rank
    if p == 1:
        return
    tag = group.tags.allocator().tag("barrier")
    distance = 1
    while distance < p:
        token = np.empty(0, dtype=np.uint8)
        receive = group.irecv(token, (r - distance) % p, tag)
        send = group.isend(_EMPTY, (r + distance) % p, tag)
        yield from wait_all((receive, send))
        distance *= 2
