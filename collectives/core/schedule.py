"""Step machines, and the scheduler that runs several of them on one thread.

An algorithm written as a step machine is a generator that posts non-blocking sends and receives
and yields each `Pending` it must see completed before it can go on (a receive it reduces, the
sends that must leave a buffer before it is overwritten). Run alone (`drive`) it is the plain
blocking algorithm: every yield is a `Group.wait`. Run as stages of a pipeline (`run_pipeline`), one
thread advances several of them and waits for whichever operation completes first, so the phases of
a collective overlap without a second thread. That matters because a transport may not be safe for
two threads inside one collective, and because the simulated backend times each rank as one thread
on its virtual clock: a helper thread there would stop the simulation.

Every wait goes through the collective's `Group`, so it keeps its deadline and the header
agreement's progress, and a failure names rank, peer and tag as a single wait would.

The pipeline scheduler is itself a generator (`pipeline_steps`, a `Waits`: it yields one `Pending`
or a list to wait for the first of), so a whole collective can be driven without blocking: `drive`
runs it on the calling thread with `Group.wait`/`Group.wait_any`, while the simulated backend runs
the collectives of every rank in one thread on its event queue (`collectives.selection.simulation`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

from collectives.core.group import Group, Pending

Steps = Generator[Pending, None, None]
"""A step machine: yields what it waits for; resumed once that has completed."""

Stage = Callable[[int], Steps]
"""stage(block): the step machine of one pipeline stage on one block."""

Waits = Generator[Pending | list[Pending], int | None, None]
"""A step machine that may also wait for the first of several operations: it yields a `Pending`
(resumed with None once it completed) or a list of them (resumed with the index of the first one
found completed, in list order, as `Group.wait_any` returns it). Every `Steps` is one."""


class _Machine:
    """One stage running on one block, and what it waits on (None while it can go on)."""

    __slots__ = ("stage", "block", "steps", "pending")

    def __init__(self, stage: int, block: int, steps: Steps) -> None:
        self.stage = stage
        self.block = block
        self.steps = steps
        self.pending: Pending | None = None


def drive(group: Group, waits: Waits | Steps) -> None:
    """Run a step machine to the end on this thread, blocking in `group` for what it yields: the
    blocking form of every algorithm."""
    try:
        item = next(waits)
        while True:
            if isinstance(item, Pending):
                group.wait(item)
                item = waits.send(None)
            else:
                item = waits.send(group.wait_any(item))
    except StopIteration:
        return


def run_pipeline(group: Group, stages: Sequence[Stage], blocks: int, windows: Sequence[int] | None = None) -> None:
    """Run every stage on every block, as `pipeline_steps` orders them, blocking on this thread."""
    drive(group, pipeline_steps(stages, blocks, windows))


def pipeline_steps(stages: Sequence[Stage], blocks: int, windows: Sequence[int] | None = None) -> Waits:
    """Run every stage on every block: stage k on block b starts once stage k-1 has finished block
    b and stage k has finished every block before b - windows[k] + 1.

    A window of 1 (the default) runs a stage on one block at a time; a wider window lets a stage
    work on several blocks at once, so a link never idles while one block waits on a round trip
    (the blocks' messages must then be told apart, e.g. by tags). All machines that can go on are
    advanced (later stages first, so finished blocks leave the pipeline before new ones enter it;
    older blocks first within a stage), then the scheduler waits for the first completion among
    the operations they wait on, oldest first in what it yields, so a timeout names the operation
    waited on longest. The operations carry their own peers and tags, so any group of the
    collective (they share deadline and agreement) can wait for them.

    Only a finished block can let other machines start, so after a completion the scheduler
    advances just the machine that waited for it, and sweeps the stages for machines to start only
    when that machine finished its block, from its stage down, as a sweep over every stage would
    have reached it: the same order at a fraction of the cost, which matters because this runs
    once per message of the collective, and the simulated backend pays it for every rank.
    """
    count = len(stages)
    windows = [1] * count if windows is None else list(windows)
    done = [[False] * blocks for _ in range(count)]
    lowest = [0] * count
    """Per stage: the first block it has not finished."""
    started = [0] * count
    running: list[list[_Machine]] = [[] for _ in range(count)]
    """Per stage, its machines in block order."""
    outstanding: list[_Machine] = []
    """The machines waiting, in the order they started waiting."""

    def advance(machine: _Machine) -> bool:
        """Run `machine` to its next wait (queued in `outstanding`); True if it finished instead."""
        try:
            machine.pending = next(machine.steps)
        except StopIteration:
            stage = machine.stage
            running[stage].remove(machine)
            done[stage][machine.block] = True
            while lowest[stage] < blocks and done[stage][lowest[stage]]:
                lowest[stage] += 1
            return True
        outstanding.append(machine)
        return False

    def start_and_advance(top: int) -> None:
        """Start every block that may start and advance every machine that can go on, stages
        `top` and below first, then all of them again until nothing changes."""
        sweep = True
        while sweep:  # again after a machine finished a block: the next stage may start it
            sweep = top < count - 1  # what stages `top` and below finished may start later ones
            for stage in reversed(range(top + 1)):
                machines = running[stage]
                progress = True
                while progress:  # again after a block finished: this stage may start one more
                    progress = False
                    block = started[stage]
                    while (
                        block < blocks
                        and block < lowest[stage] + windows[stage]
                        and (stage == 0 or done[stage - 1][block])
                    ):
                        machines.append(_Machine(stage, block, stages[stage](block)))
                        block = started[stage] = block + 1
                    for machine in [machine for machine in machines if machine.pending is None]:
                        if advance(machine):
                            progress = sweep = True
            top = count - 1

    start_and_advance(count - 1)
    while outstanding:
        if len(outstanding) == 1:  # nothing to overlap: wait as a blocking algorithm would
            machine = outstanding.pop()
            yield machine.pending
        else:
            index = yield [machine.pending for machine in outstanding]
            machine = outstanding.pop(index)
        machine.pending = None
        if advance(machine):  # as a full sweep would have found it, at its stage's turn
            start_and_advance(machine.stage)
