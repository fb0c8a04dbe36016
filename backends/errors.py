"""The library's error hierarchy.

It lives in the lowest layer because transports raise these errors themselves; `collectives`
re-exports every name as part of its public API. Every message is written for the person reading
a log from one rank of many: it names the rank that raised, the peer involved and what was expected.
"""

from __future__ import annotations

import sys
from collections.abc import Container


class CollectiveError(RuntimeError):
    """Base class of every error a collective operation or a transport raises."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A peer did not deliver (or accept) a message before the collective's deadline."""

    def __init__(self, message: str, *, rank: int, peer: int, tag: int, seconds: float) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.tag = tag
        self.seconds = seconds


class MismatchError(CollectiveError):
    """Ranks called the same collective with different arguments (shape, dtype, op, algorithm...)."""


class PeerLostError(CollectiveError):
    """A peer aborted, exited or became unreachable, so the collective cannot complete."""


class CommunicatorBrokenError(CollectiveError):
    """The communicator failed earlier and refuses further work instead of hanging."""


class ConcurrentUseError(CollectiveError):
    """Two threads called collectives on one communicator at the same time.

    Every rank must issue the collectives of a communicator in one order; threads racing each
    other order them differently on different ranks, which pairs one thread's data with another's.
    The communicator is broken on every rank instead; each thread needs a communicator of its own
    (`Communicator.dup`).
    """


class BackendUnavailableError(CollectiveError, ImportError):
    """An optional dependency needed by a backend is not installed, or what it drives is missing
    (`reason`: no GPU, CuPy without NCCL)."""

    def __init__(self, backend: str, module: str, extra: str, reason: str | None = None) -> None:
        super().__init__(
            f"the {backend!r} backend cannot start: {reason}"
            if reason
            else f"the {backend!r} backend needs the Python package {module!r}, which is not installed; "
            f"install it with: pip install -e '.[{extra}]'"
        )
        self.backend = backend
        self.module = module
        self.extra = extra
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str, str, str | None]]:
        """Rebuild from the constructor's arguments, so the error survives pickling (a worker process's error)."""
        return type(self), (self.backend, self.module, self.extra, self.reason)


ABORT_MISMATCH = "mismatch"
ABORT_LOST = "lost"
ABORT_CLOSED = "closed"
"""The kind of a notice that a peer closed cleanly (`Transport.leaving`), not an abort."""

ENDED_MID_COLLECTIVE = (
    "the program is ending with collectives not finished, so they are abandoned and the peers are "
    "told that this rank left; wait for every asynchronous collective's Work, or close() the "
    "communicator, before the program ends"
)
"""What a rank whose program ends mid-collective says of itself (its peers hear that it left)."""


def departure_text(running: bool) -> str:
    """What a rank's closing note (`Transport.leaving`) tells a peer that waits in a collective
    it will never finish: "peer rank r " + this (`error_from_abort` with `ABORT_CLOSED`)."""
    if running:
        return (
            "exited in the middle of a collective (this one or an earlier one), so this one cannot "
            "complete: did its program end, or raise, with asynchronous collectives still running?"
        )
    return (
        "closed its communicator (or exited) after its last collective, so this one cannot complete: "
        "this rank called more collectives than it did (uneven data across ranks, or a loop that ran once more?)"
    )


LIBRARY_TAGS = 1 << 30
"""Tags the library sends on lie in [0, LIBRARY_TAGS); a communicator's collectives take them in
blocks, in call order, wrapping around at the end."""


def abort_reaches(tag: int, since_tag: int | None) -> bool:
    """Whether an abort that fails operations from `since_tag` on (None: all of them) fails one on `tag`.

    A rank aborts because a collective failed; the collectives it had completed before it are
    complete on its side, and a slower peer still finishing one of them (its `init()`, say) must be
    able to. Their tags come before the failed collective's: within the half of the (circular)
    tag space before `since_tag`.
    """
    return since_tag is None or (tag - since_tag) % LIBRARY_TAGS < LIBRARY_TAGS // 2


def earlier_abort(first: int | None, second: int | None) -> int | None:
    """The `since_tag` of two aborts that fails what either fails."""
    if first is None or second is None:
        return None
    return second if abort_reaches(first, second) else first


def abort_kind(error: BaseException) -> str:
    """The kind under which an error is propagated to peers when a rank aborts."""
    return ABORT_MISMATCH if isinstance(error, MismatchError) else ABORT_LOST


def post_refusal(
    abort: tuple[int, str, str] | None, closed: Container[int], rank: int, peer: int
) -> CollectiveError | None:
    """Why an in-process fabric must fail a new send or receive between `rank` and `peer` at once,
    or None: the world aborted (`abort` is its (origin, kind, text)), or either side has closed."""
    if abort is not None:
        return error_from_abort(*abort, rank=rank)
    if rank in closed:
        return PeerLostError(f"rank {rank}: transport already closed")
    if peer in closed:
        return PeerLostError(
            f"rank {rank}: peer rank {peer} has closed its transport; this rank called more collectives "
            f"than it did (uneven data across ranks, or a loop that ran once more?)"
        )
    return None


CALLER = -1
"""The origin of an abort that no rank caused: the program that runs the ranks (`run_threads`
interrupted by Ctrl-C)."""


def error_from_abort(origin: int, kind: str, text: str, *, rank: int) -> CollectiveError:
    """Rebuild, on `rank`, the error that made rank `origin` abort.

    A mismatch stays a `MismatchError` on every rank (each rank can then report both sides);
    anything else surfaces as `PeerLostError` naming the rank that failed first (none for
    `CALLER`).
    """
    if origin == CALLER:
        return PeerLostError(f"rank {rank}: {text}")
    if kind == ABORT_MISMATCH:
        return MismatchError(f"{text} (reported to rank {rank} by rank {origin})")
    if kind == ABORT_CLOSED:
        return PeerLostError(f"rank {rank}: peer rank {origin} {text}")
    return PeerLostError(f"rank {rank}: peer rank {origin} aborted: {text}")


def add_note(error: BaseException, note: str) -> None:
    """`BaseException.add_note`, also on Python 3.10, which keeps the note in `__notes__` without
    printing it."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        setattr(error, "__notes__", [*getattr(error, "__notes__", ()), note])  # noqa: B010 - no such attribute before 3.11
