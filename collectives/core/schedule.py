"""Step machines: algorithms as generators that say what they wait for, and the drivers that run them.

An algorithm written as a step machine posts non-blocking sends and receives, and whenever it
cannot go on before one of them has completed (a receive it reduces, the sends that must leave a
buffer before it is overwritten) it yields a `WaitAny` of them; it is resumed with the index of the
one that completed. That is the whole protocol. Algorithms read as straight lines through a few
verbs::

    yield wait(receive)                       # one operation
    first = yield wait_any(receives)          # the first of several to complete: its index
    yield from wait_all(sends)                # every one, in order

A wait is a value the machine yields; whatever takes several steps (`wait_all`, another algorithm,
a composite step such as `ReduceStream.next_segment`, NCCL's recvReduce) is a step machine of its
own, run inline with `yield from`. Waiting for one operation thus costs no generator of its own,
which matters on the simulated backend, where a wait is a good part of the cost of a message.

A driver runs a step machine to its end: it waits for the first completion among what the machine
yields and resumes the machine with its index; an operation that failed raises its error inside
the machine, where it waited, as a blocking wait would. There are two drivers:

- `drive(group, steps)` blocks the calling thread in `Group.wait_any`, so every wait keeps the
  collective's deadline and advances its header agreement, and a failure names rank, peer and tag
  as a single wait would. It is the blocking form of every algorithm.
- The simulated backend advances the machines of every rank on its event queue, in one thread
  (`collectives.selection.simulation.rank_steps` hands it the requests of each wait;
  `collectives.backends.simulated.simulate_steps` waits for the first of them on the virtual clock).

Because one thread can drive several machines, the phases of a collective can overlap without a
second thread: `pipeline_steps` runs stages over blocks and is itself a step machine. That matters
because a transport may not be safe for two threads inside one collective, and because the
simulated backend times each rank as one thread on its virtual clock: a helper thread there would
stop the simulation.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence

from collectives.core.group import Group, Pending


class WaitAny(tuple[Pending, ...]):
    """What a step machine yields: the operations it waits for; it is resumed with the index of the
    first of them found completed, in this order (the first is the one a timeout names).

    A tuple subclass: immutable, and as cheap to make as a tuple (one is made per wait).
    """

    __slots__ = ()


Steps = Generator[WaitAny, int, None]
"""A step machine: yields what it waits for, resumed with the index of what completed."""

Stage = Callable[[int], Steps]
"""stage(block): the step machine of one pipeline stage on one block."""


def wait(pending: Pending) -> WaitAny:
    """The wait for one operation: `yield wait(receive)`."""
    return WaitAny((pending,))


def wait_any(pendings: Iterable[Pending]) -> WaitAny:
    """The wait for the first of `pendings` to complete: `first = yield wait_any(receives)` gives
    its index."""
    return WaitAny(pendings)


def wait_all(pendings: Iterable[Pending]) -> Steps:
    """Wait for every operation, one after another in the given order: `yield from wait_all(sends)`."""
    for pending in pendings:
        yield WaitAny((pending,))


def drive(group: Group, steps: Steps) -> None:
    """Run a step machine to its end on this thread, blocking in `group` for what it waits for:
    the blocking driver. Any group of the collective will do (they share deadline and agreement):
    the operations carry their own peers and tags."""
    wait_for_first = group.wait_any
    try:
        waiting = next(steps)
        while True:
            try:
                index = wait_for_first(waiting)
            except Exception as error:  # noqa: BLE001 - raised inside the machine, where it waited
                waiting = steps.throw(error)
            else:
                waiting = steps.send(index)
    except StopIteration:
        return


_RUNNABLE = WaitAny()
"""What a pipeline machine that can go on waits for: nothing."""


class _Machine:
    """One stage running on one block, and what it waits for (nothing while it can go on)."""

    __slots__ = ("stage", "block", "steps", "waiting")

    def __init__(self, stage: int, block: int, steps: Steps) -> None:
        self.stage = stage
        self.block = block
        self.steps = steps
        self.waiting = _RUNNABLE


def pipeline_steps(stages: Sequence[Stage], blocks: int, windows: Sequence[int] | None = None) -> Steps:
    """Run every stage on every block: stage k on block b starts once stage k-1 has finished block
    b and stage k has finished every block before b - windows[k] + 1.

    A window of 1 (the default) runs a stage on one block at a time; a wider window lets a stage
    work on several blocks at once, so a link never idles while one block waits on a round trip
    (the blocks' messages must then be told apart, by groups on tags of their own). All machines
    that can go on are advanced (later stages first, so finished blocks leave the pipeline before
    new ones enter it; older blocks first within a stage), then the scheduler waits for the first
    completion among the operations they wait for, those of the machine waiting longest first, so
    a timeout names the operation waited on longest.

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
    waiting_for_several = 0
    """How many of them wait for the first of several operations."""

    def advance(machine: _Machine, index: int | None) -> bool:
        """Start `machine` (index None) or resume it with the index of what completed, up to its
        next wait (queued in `outstanding`); True if it finished instead."""
        try:
            machine.waiting = next(machine.steps) if index is None else machine.steps.send(index)
        except StopIteration:
            stage = machine.stage
            running[stage].remove(machine)
            done[stage][machine.block] = True
            while lowest[stage] < blocks and done[stage][lowest[stage]]:
                lowest[stage] += 1
            return True
        outstanding.append(machine)
        if len(machine.waiting) > 1:
            nonlocal waiting_for_several
            waiting_for_several += 1
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
                    for machine in [machine for machine in machines if not machine.waiting]:
                        if advance(machine, None):
                            progress = sweep = True
            top = count - 1

    start_and_advance(count - 1)
    while outstanding:
        if len(outstanding) == 1:  # nothing to overlap: wait as the machine alone would
            machine = outstanding.pop()
            index = yield machine.waiting
        elif waiting_for_several == 0:  # every machine waits for one operation (the usual case)
            machine = outstanding.pop((yield WaitAny([machine.waiting[0] for machine in outstanding])))
            index = 0
        else:
            index = yield WaitAny([pending for machine in outstanding for pending in machine.waiting])
            position = 0
            while index >= len(outstanding[position].waiting):  # find whose operation it was
                index -= len(outstanding[position].waiting)
                position += 1
            machine = outstanding.pop(position)
        if len(machine.waiting) > 1:
            waiting_for_several -= 1
        machine.waiting = _RUNNABLE
        if advance(machine, index):  # as a full sweep would have found it, at its stage's turn
            start_and_advance(machine.stage)
