"""Step machines, and the scheduler that runs several of them on one thread.

An algorithm written as a step machine is a generator that posts non-blocking sends and receives
and yields each `Pending` it must see completed before it can go on (a receive it reduces, the
sends that must leave a buffer before it is overwritten). Run alone (`run_steps`) it is the plain
blocking algorithm: every yield is a `Group.wait`. Run as stages of a pipeline (`run_pipeline`), one
thread advances several of them and waits for whichever operation completes first, so the phases of
a collective overlap without a second thread. That matters because a transport may not be safe for
two threads inside one collective, and because the simulated backend times each rank as one thread
on its virtual clock: a helper thread there would stop the simulation.

Every wait goes through the collective's `Group`, so it keeps its deadline and the header
agreement's progress, and a failure names rank, peer and tag as a single wait would.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from .group import Group, Pending

Steps = Iterator[Pending]
"""A step machine: yields what it waits for; resumed once that has completed."""

Stage = Callable[[int], Steps]
"""stage(block): the step machine of one pipeline stage on one block."""


def run_steps(group: Group, steps: Steps) -> None:
    """Run one step machine to the end, waiting for what it yields in turn."""
    for pending in steps:
        group.wait(pending)


def run_pipeline(group: Group, stages: Sequence[Stage], blocks: int) -> None:
    """Run every stage on every block: stage k on block b starts once stage k-1 has finished block
    b and stage k has finished block b-1.

    All stages that can go on are advanced (later stages first, so finished blocks leave the
    pipeline before new ones enter it), then the scheduler waits for the first completion among
    the operations they wait on; a timeout names the operation waited on longest. `group` is any
    group of the collective (they share deadline and agreement): the operations carry their own
    peers and tags.
    """
    count = len(stages)
    machines: list[Steps | None] = [None] * count
    waiting: list[tuple[int, Pending] | None] = [None] * count
    """Per stage: (when it started waiting, what on), or None while it can run."""
    started = [0] * count
    finished = [0] * count
    clock = 0
    while True:
        sweep = True
        while sweep:  # again after a stage finished a block: the next stage may start it
            sweep = False
            for stage in reversed(range(count)):
                while waiting[stage] is None:
                    machine = machines[stage]
                    if machine is None:
                        if started[stage] == blocks or (stage > 0 and finished[stage - 1] == started[stage]):
                            break
                        machine = machines[stage] = stages[stage](started[stage])
                        started[stage] += 1
                    try:
                        waiting[stage] = (clock, next(machine))
                        clock += 1
                    except StopIteration:
                        machines[stage] = None
                        finished[stage] += 1
                        sweep = True
        outstanding = sorted((entry, stage) for stage, entry in enumerate(waiting) if entry is not None)
        if not outstanding:
            return
        if len(outstanding) == 1:  # nothing to overlap: wait as a blocking algorithm would
            (_, pending), stage = outstanding[0]
            group.wait(pending)
        else:
            stage = outstanding[group.wait_any([pending for (_, pending), _ in outstanding])][1]
        waiting[stage] = None
