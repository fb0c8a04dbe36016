"""`Communicator`: the user-facing object that runs collectives over one transport.

It owns what must be identical on every rank for collectives to be safe:

* the order of operations: every call is queued to one communication thread and run in call order,
  and gets the next tag block, so the k-th collective of every rank meets the k-th of the others;
* the algorithm choice, made from data every rank has (message size, topology, and the link costs
  and tuning that `probe()` and `tune()` measure and share); `explain(nbytes)` shows it;
* the header each message carries, which turns a rank calling with another shape, dtype, op,
  root or algorithm into a `MismatchError` on every rank instead of garbage or a hang;
* the deadline of every wait, and the broken state: after a failure the communicator tells its
  peers (`Transport.abort`) and refuses further work at once.

Blocking calls are the async ones plus `wait()`. Inputs are read, never written (unless `out` is
the input); async callers must not modify an input until its `Work` is done.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import itertools
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from collectives._version import __version__
from collectives.algorithms.allreduce import ALLREDUCE_ALGORITHMS, run_allreduce
from collectives.algorithms.barrier import dissemination_barrier_steps
from collectives.algorithms.ring import ring_allgather_steps, ring_reduce_scatter_steps
from collectives.algorithms.tree import tree_broadcast_steps
from collectives.backends.base import Transport
from collectives.backends.errors import CollectiveTimeoutError, CommunicatorBrokenError
from collectives.core.group import Group
from collectives.core.layout import DEFAULT_SEGMENT_BYTES, even_bounds
from collectives.core.ops import ReduceOp, check_reduction, finalize
from collectives.core.schedule import drive
from collectives.core.tags import collective_tags
from collectives.core.topology import DEFAULT_LINK_COSTS, LinkCosts, Topology
from collectives.selection.probe import probe_links
from collectives.selection.selector import Explanation, Selector, Tuning
from collectives.selection.tuning import TUNE_SIZES, cache_file, decode, default_cache_dir, encode, measure

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0
"""Seconds any single collective may take before it fails with `CollectiveTimeoutError`."""

NATIVE = "native"
"""The backend's own all-reduce (MPI_Allreduce, ncclAllReduce), where it has one."""

_HOST_RECORD_BYTES = 128
_TAG_WRAP = 1 << 24


class Work(concurrent.futures.Future):
    """Handle of an asynchronous collective; a `concurrent.futures.Future` with `wait`.

    Collectives cannot be cancelled: every rank must run the same sequence of them.
    `started_at` and `finished_at` (`time.perf_counter()` seconds, None until then) say when the
    collective actually ran, which is later than its submission when others were queued ahead
    of it; timelines use them to show communication against computation.
    """

    def __init__(self) -> None:
        super().__init__()
        self._run_here: Callable[[], None] | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective finishes and return its result (or raise its error).

        Raises:
            TimeoutError: `timeout` seconds passed first (the collective keeps running).
        """
        if self._run_here is not None:  # a blocking call that found the communicator idle
            run, self._run_here = self._run_here, None
            run()
        return self.result(timeout)

    def cancel(self) -> bool:
        return False


@dataclass
class _Task:
    seq: int
    header: bytes
    run: Callable[[Group], Any]
    work: Work


class Communicator:
    """Collective operations among the ranks reachable through `transport`.

    Args:
        transport: this rank's endpoint (threads, MPI, gRPC, ...).
        timeout: seconds each collective may take before failing with `CollectiveTimeoutError`.
        segment_bytes: pipelining granularity of the algorithms.
        autotune: run `tune()` (which reuses a cached tuning file when there is one) at the first
            all-reduce with `algorithm="auto"`; every rank must pass the same value.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        autotune: bool = False,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
        self._transport = transport
        self.timeout = float(timeout)
        self.segment_bytes = int(segment_bytes)
        self.last_algorithm: str | None = None
        """The algorithm the most recent all-reduce call resolved to (after "auto")."""
        self._broken: BaseException | None = None
        self._closed = False
        self._sequence = itertools.count(1)
        self._next_to_run = 1  # sequence number of the collective allowed to start next
        self._submit_lock = threading.Lock()
        self._turn = threading.Condition(self._submit_lock)
        self._calling_thread = threading.local()
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self.topology = Topology(self._exchange_hosts())
        self._selector = Selector(self.topology, DEFAULT_LINK_COSTS, self.segment_bytes)
        self._autotune_pending = autotune
        self._work_space = np.empty(0, dtype=np.uint8)
        """Scratch kept between collectives (see `_reusable_work_space`)."""
        self._thread = threading.Thread(target=self._serve, name=f"collectives-rank{self.rank}", daemon=True)
        self._thread.start()

    # -- identity ---------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._transport.rank

    @property
    def size(self) -> int:
        return self._transport.size

    @property
    def node(self) -> int:
        """Index of this rank's node (nodes numbered by their lowest rank)."""
        return self.topology.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.topology.local_rank(self.rank)

    @property
    def local_size(self) -> int:
        return self.topology.local_size(self.rank)

    @property
    def algorithms(self) -> tuple[str, ...]:
        """The all-reduce algorithms usable here: the library's, plus "native" if the backend has one."""
        native = (NATIVE,) if self._transport.has_native_allreduce else ()
        return (*ALLREDUCE_ALGORITHMS, *native)

    def clock(self) -> float:
        """Seconds on the clock collectives are timed with (virtual on the simulated backend)."""
        return self._transport.clock()

    @property
    def link_costs(self) -> LinkCosts:
        """The cost-model parameters `auto` uses: defaults until `probe()` or `tune()`."""
        return self._selector.costs

    @property
    def native_dtypes(self) -> tuple[np.dtype, ...]:
        """The dtypes algorithm="native" accepts on this backend (none if it has no native one)."""
        return self._transport.native_dtypes

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def __repr__(self) -> str:
        state = "broken" if self.broken else "closed" if self._closed else "ok"
        return (
            f"<Communicator rank {self.rank}/{self.size} node {self.node} "
            f"local {self.local_rank}/{self.local_size} {state}>"
        )

    # -- collectives ------------------------------------------------------------------------------

    def allreduce(
        self, x: Any, op: str | ReduceOp = "sum", algorithm: str = "auto", out: np.ndarray | None = None
    ) -> np.ndarray:
        """Reduce `x` elementwise over all ranks; every rank gets the identical result.

        Args:
            x: array of any shape; dtype float16/32/64 or int32/64.
            op: "sum", "mean", "max", "min" or "prod".
            algorithm: "auto" or one of `ALLREDUCE_ALGORITHMS`; the choice is in `last_algorithm`.
            out: array of x's shape and dtype to write into (`out=x` reduces in place).

        Returns:
            The reduced array (`out` if given), of x's shape and dtype.
        """
        with self._blocking_call():
            work = self.allreduce_async(x, op, algorithm, out)
        return work.wait()

    def allreduce_async(
        self, x: Any, op: str | ReduceOp = "sum", algorithm: str = "auto", out: np.ndarray | None = None
    ) -> Work:
        """Start `allreduce`; returns a `Work` whose result is the reduced array."""
        op = ReduceOp.parse(op)
        src = _as_array(x)
        check_reduction(op, src.dtype)
        chosen = self._choose_allreduce(algorithm, src.nbytes)
        if chosen == NATIVE and src.dtype not in self._transport.native_dtypes:
            supported = ", ".join(str(d) for d in self._transport.native_dtypes)
            raise TypeError(f"algorithm 'native' cannot reduce {src.dtype} on this backend; it supports {supported}")
        self.last_algorithm = chosen
        result, target = _output(out, src.shape, src.dtype)
        flat = _flat(src)
        if self.size == 1:
            return _done(_copy_back(result, target, flat))
        nodes = self.topology.nodes

        def run(group: Group) -> np.ndarray:
            if chosen == NATIVE:
                native_op = "sum" if op is ReduceOp.MEAN else op.value
                try:
                    self._transport.native_allreduce(
                        flat, target, native_op, timeout=max(group.deadline - time.monotonic(), 0.0)
                    )
                except TimeoutError:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: native all-reduce did not complete within {self.timeout:g} s "
                        f"({group.header.decode(errors='replace')}); a rank never arrived, or is stuck or dead",
                        rank=self.rank,
                        peer=-1,
                        tag=group.tags.start,
                        seconds=self.timeout,
                    ) from None
                finalize(op, target, self.size)
            else:
                run_allreduce(chosen, group, nodes, flat, target, op, segment_bytes=self.segment_bytes)
            return _copy_back(result, target)

        return self._submit(_header("allreduce", src, algorithm=chosen, op=op.value), run)

    def reduce_scatter(self, x: Any, op: str | ReduceOp = "sum", out: np.ndarray | None = None) -> np.ndarray:
        """Reduce `x` over all ranks and keep this rank's block of rows (ring algorithm).

        The first axis is split as evenly as possible, the first `x.shape[0] % size` ranks getting
        one row more (as Horovod does).

        Returns:
            This rank's rows of the reduction, shape (rows_of_this_rank, *x.shape[1:]).
        """
        with self._blocking_call():
            work = self.reduce_scatter_async(x, op, out)
        return work.wait()

    def reduce_scatter_async(self, x: Any, op: str | ReduceOp = "sum", out: np.ndarray | None = None) -> Work:
        """Start `reduce_scatter`; returns a `Work` whose result is this rank's block."""
        op = ReduceOp.parse(op)
        src = _as_array(x)
        check_reduction(op, src.dtype)
        if src.ndim == 0:
            raise ValueError("reduce_scatter needs an array with at least one dimension to split")
        rows = even_bounds(src.shape[0], self.size)
        row_items = math.prod(src.shape[1:])
        bounds = [row * row_items for row in rows]
        shape = (rows[self.rank + 1] - rows[self.rank], *src.shape[1:])
        result, target = _output(out, shape, src.dtype)
        flat = _flat(src)
        mine = slice(bounds[self.rank], bounds[self.rank + 1])
        if self.size == 1:
            return _done(_copy_back(result, target, flat[mine]))

        def run(group: Group) -> np.ndarray:
            work_space = self._reusable_work_space(flat)
            drive(
                group, ring_reduce_scatter_steps(group, flat, work_space, op, bounds, segment_bytes=self.segment_bytes)
            )
            finalize(op, work_space[mine], self.size)
            return _copy_back(result, target, work_space[mine])

        return self._submit(_header("reduce_scatter", src, algorithm="ring", op=op.value), run)

    def allgather(self, x: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Concatenate every rank's `x` (same shape on all ranks) along the first axis, rank order.

        Returns:
            Shape (size * x.shape[0], *x.shape[1:]); a 0-d `x` gives shape (size,).
        """
        with self._blocking_call():
            work = self.allgather_async(x, out)
        return work.wait()

    def allgather_async(self, x: Any, out: np.ndarray | None = None) -> Work:
        """Start `allgather`; returns a `Work` whose result is the concatenation."""
        src = _as_array(x, reduction=False)
        rows = src.shape[0] if src.ndim else 1
        shape = (self.size * rows, *src.shape[1:])
        result, target = _output(out, shape, src.dtype)
        bounds = [rank * src.size for rank in range(self.size + 1)]
        flat = _flat(src)
        own = slice(bounds[self.rank], bounds[self.rank + 1])
        if self.size == 1:
            return _done(_copy_back(result, target, flat))

        def run(group: Group) -> np.ndarray:
            target[own] = flat
            drive(group, ring_allgather_steps(group, target, bounds, segment_bytes=self.segment_bytes))
            return _copy_back(result, target)

        return self._submit(_header("allgather", src, algorithm="ring"), run)

    def broadcast(self, x: Any, root: int = 0, out: np.ndarray | None = None) -> np.ndarray:
        """Return rank `root`'s `x` on every rank (pipelined binary tree).

        Every rank passes an array of the same shape and dtype; only the root's values are used.
        `out=x` broadcasts in place, like MPI_Bcast.
        """
        with self._blocking_call():
            work = self.broadcast_async(x, root, out)
        return work.wait()

    def broadcast_async(self, x: Any, root: int = 0, out: np.ndarray | None = None) -> Work:
        """Start `broadcast`; returns a `Work` whose result is the root's array."""
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"root must be a rank in 0..{self.size - 1}, got {root!r}")
        root = int(root)
        src = _as_array(x, reduction=False)
        result, target = _output(out, src.shape, src.dtype)
        flat = _flat(src)
        if self.size == 1:
            return _done(_copy_back(result, target, flat))

        def run(group: Group) -> np.ndarray:
            if group.rank == root and not np.may_share_memory(target, flat):
                target[...] = flat
            drive(group, tree_broadcast_steps(group, target, root, segment_bytes=self.segment_bytes))
            return _copy_back(result, target)

        return self._submit(_header("broadcast", src, algorithm="tree", root=root), run)

    def barrier(self) -> None:
        """Return only after every rank has called `barrier`."""
        with self._blocking_call():
            work = self.barrier_async()
        work.wait()

    def barrier_async(self) -> Work:
        """Start `barrier`; returns a `Work` whose result is None."""
        if self.size == 1:
            return _done(None)
        return self._submit(b"barrier", lambda group: drive(group, dissemination_barrier_steps(group)))

    # -- algorithm selection ----------------------------------------------------------------------

    def explain(self, nbytes: int) -> Explanation:
        """What `algorithm="auto"` would choose for an all-reduce of `nbytes`, and why: the predicted
        (and, after `tune()`, corrected) time of every candidate. `print()` it for a table."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return self._selector.explain(int(nbytes))

    def probe(self) -> LinkCosts:
        """Measure latency and bandwidth inside and across nodes, and the reduction speed, and let
        `auto` use them. A collective: every rank calls it at the same point; all get the same
        numbers. Takes a few milliseconds on threads, well under a second on a network."""
        if self.size == 1:
            return self._selector.costs
        topology = self.topology
        with self._blocking_call():
            work = self._submit(b"probe links", lambda group: probe_links(group, topology))
        costs = work.wait()
        self._selector = Selector(self.topology, costs, self.segment_bytes)
        return costs

    def tune(
        self,
        sizes: tuple[int, ...] = TUNE_SIZES,
        *,
        cache_dir: str | os.PathLike | None = None,
        use_cache: bool = True,
    ) -> Tuning:
        """Probe, then time every candidate at `sizes` and correct the model with the
        measured/predicted ratios (a collective; see `collectives.selection.tuning`).

        The result is saved under `cache_dir` (default `$COLLECTIVES_TUNING_DIR` or
        ~/.cache/collectives) keyed by the topology's fingerprint, and reused from there by later
        runs with the same layout unless `use_cache=False`.
        """
        if self.size == 1:
            return Tuning(())
        fingerprint = self.topology.fingerprint(
            f"{type(self._transport).__name__}|segment={self.segment_bytes}|{__version__}"
        )
        path = cache_file(cache_dir if cache_dir is not None else default_cache_dir(), fingerprint)
        if use_cache and (cached := self._read_shared(path, fingerprint)) is not None:
            costs, tuning = cached
        else:
            costs = self.probe()
            tuning = measure(self, self._selector, sorted(sizes))
            if use_cache and self.rank == 0:
                path.parent.mkdir(parents=True, exist_ok=True)
                scratch = path.with_suffix(f".{os.getpid()}.tmp")
                scratch.write_bytes(encode(costs, tuning, fingerprint))
                scratch.replace(path)
        self._selector = Selector(self.topology, costs, self.segment_bytes, tuning)
        return tuning

    def _read_shared(self, path: os.PathLike, fingerprint: str) -> tuple[LinkCosts, Tuning] | None:
        """Rank 0's copy of a tuning file, broadcast so that every rank decodes the same bytes."""
        data = b""
        if self.rank == 0:
            try:
                data = open(path, "rb").read()
            except OSError:
                pass
        length = int(self.broadcast(np.array([len(data)], dtype=np.int64))[0])
        if length == 0:
            return None
        payload = np.frombuffer(data, dtype=np.uint8) if self.rank == 0 else np.empty(length, dtype=np.uint8)
        return decode(self.broadcast(payload).tobytes(), fingerprint)

    # -- life cycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued collectives, stop the communication thread and close the transport."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._work_space = np.empty(0, dtype=np.uint8)
        self._transport.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _choose_allreduce(self, algorithm: str, nbytes: int) -> str:
        if algorithm != "auto":
            if algorithm not in (*ALLREDUCE_ALGORITHMS, NATIVE):
                names = ", ".join(repr(a) for a in ("auto", *ALLREDUCE_ALGORITHMS, NATIVE))
                raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; expected one of {names}")
            if algorithm == NATIVE and not self._transport.has_native_allreduce:
                raise ValueError(
                    f"algorithm 'native' needs a backend with its own all-reduce (MPI, NCCL); "
                    f"{type(self._transport).__name__} has none"
                )
            return algorithm
        if self._autotune_pending:
            self._autotune_pending = False
            self.tune()
        return self._selector.choose(nbytes)

    def _unusable(self) -> CommunicatorBrokenError | None:
        """Why no new collective may start, or None."""
        if self._broken is not None:
            return CommunicatorBrokenError(
                f"rank {self.rank}: the communicator is broken since an earlier collective failed "
                f"({type(self._broken).__name__}: {self._broken}); create a new one"
            )
        if self._closed:
            return CommunicatorBrokenError(f"rank {self.rank}: the communicator is closed")
        return None

    @contextlib.contextmanager
    def _blocking_call(self) -> Iterator[None]:
        """Mark collectives submitted inside as ones whose caller waits for them at once."""
        self._calling_thread.blocking = True
        try:
            yield
        finally:
            self._calling_thread.blocking = False

    def _submit(self, header: bytes, run: Callable[[Group], Any]) -> Work:
        """Queue a collective for the communication thread; or, for a blocking call that finds
        nothing queued or running, leave it to run on the caller's thread (saving two thread
        hand-offs, which dominate the latency of small collectives)."""
        work = Work()
        with self._submit_lock:
            if (refusal := self._unusable()) is not None:
                raise refusal
            task = _Task(next(self._sequence), header, run, work)
            if getattr(self._calling_thread, "blocking", False) and task.seq == self._next_to_run:
                work._run_here = functools.partial(self._execute, task)
            else:
                self._queue.put(task)
        return work

    def _reusable_work_space(self, like: np.ndarray) -> np.ndarray:
        """Uninitialised scratch of `like`'s size and dtype, kept for the next collective.

        A reduce-scatter needs the whole input's size as work space but returns one block; a fresh
        buffer per call costs a page fault per 4 KiB on first touch, which made a 64 MiB
        reduce-scatter as slow as a whole all-reduce. Collectives run one at a time, so one buffer,
        grown to the largest size asked for and freed by `close()`, serves them all.
        """
        if self._work_space.nbytes < like.nbytes:
            self._work_space = np.empty(like.nbytes, dtype=np.uint8)
        return self._work_space[: like.nbytes].view(like.dtype)

    def _group(self, seq: int, header: bytes) -> Group:
        tags = collective_tags(seq % _TAG_WRAP, header.decode(errors="replace"))
        deadline = time.monotonic() + self.timeout
        return Group(self._transport, tuple(range(self.size)), tags, header, deadline, self.timeout)

    def _serve(self) -> None:
        """The communication thread: run queued collectives one at a time, in call order."""
        while (task := self._queue.get()) is not None:
            with self._turn:  # a blocking call may still be running an earlier one
                self._turn.wait_for(lambda: task.seq == self._next_to_run)
            self._execute(task)

    def _execute(self, task: _Task) -> None:
        task.work.set_running_or_notify_cancel()
        task.work.started_at = time.perf_counter()
        try:
            if self._broken is not None:  # queued before the failure: fail fast, do not talk
                raise self._unusable()
            group = self._group(task.seq, task.header).with_agreement()
            result = task.run(group)
            group.finish_agreement()
        except BaseException as error:  # noqa: BLE001 - handed to the caller through Work
            if not isinstance(error, CommunicatorBrokenError):
                self._break(error)
            self._finish(task)
            task.work.set_exception(error)
        else:
            self._finish(task)
            task.work.set_result(result)

    def _finish(self, task: _Task) -> None:
        """Let the next collective start; done before the result is published, so that a caller
        woken by this result can run its next collective at once."""
        task.work.finished_at = time.perf_counter()
        with self._turn:
            self._next_to_run = task.seq + 1
            self._turn.notify_all()

    def _break(self, error: BaseException) -> None:
        """Remember the failure and make every peer fail fast instead of waiting for us."""
        if self._broken is None:
            self._broken = error
            log.error("rank %d: collective failed, communicator is now broken: %s", self.rank, error)
        self._transport.abort(error)

    def _exchange_hosts(self) -> tuple[str, ...]:
        """Learn every rank's host, so that all ranks build the same topology."""
        host = self._transport.host
        record = host.encode()
        if len(record) > _HOST_RECORD_BYTES:
            record = hashlib.blake2b(record, digest_size=_HOST_RECORD_BYTES // 4).hexdigest().encode()
        table = np.zeros(self.size * _HOST_RECORD_BYTES, dtype=np.uint8)
        table[self.rank * _HOST_RECORD_BYTES : self.rank * _HOST_RECORD_BYTES + len(record)] = np.frombuffer(
            record, np.uint8
        )
        if self.size > 1:
            header = f"communicator setup (collectives {__version__})".encode()
            group = self._group(0, header)
            bounds = [rank * _HOST_RECORD_BYTES for rank in range(self.size + 1)]
            try:
                drive(group, ring_allgather_steps(group, table, bounds))
            except BaseException as error:
                self._break(error)
                raise
        rows = table.reshape(self.size, _HOST_RECORD_BYTES)
        return tuple(bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows)


# -- argument handling ------------------------------------------------------------------------------


def _as_array(x: Any, *, reduction: bool = True) -> np.ndarray:
    """The input as a numpy array, or a TypeError saying what was expected."""
    if isinstance(x, np.ndarray):
        array = x
    elif hasattr(x, "__array__") or isinstance(x, (int, float, list, tuple)):
        array = np.asarray(x)
    else:
        raise TypeError(f"expected a numpy array (or array-like), got {type(x).__name__}")
    if not reduction and (array.dtype.hasobject or array.dtype.kind not in "biufc"):
        raise TypeError(f"cannot communicate arrays of dtype {array.dtype}; use a numeric dtype")
    return array


def _output(out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(array returned to the caller, flat contiguous buffer the algorithm writes)."""
    if out is None:
        result = np.empty(shape, dtype=dtype)
        return result, result.reshape(-1)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise ValueError(
            f"out must have shape {tuple(shape)} and dtype {dtype}, got shape {out.shape} and dtype {out.dtype}"
        )
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    if out.flags.c_contiguous:
        return out, out.reshape(-1)
    return out, np.empty(out.size, dtype=dtype)


def _flat(array: np.ndarray) -> np.ndarray:
    """A 1-D C-contiguous view of `array` (a copy only if it is not contiguous)."""
    return np.ascontiguousarray(array).reshape(-1)


def _copy_back(result: np.ndarray, target: np.ndarray, source: np.ndarray | None = None) -> np.ndarray:
    """Move `source` (if given) into `target`, then `target` into `result` if they differ."""
    if source is not None and not np.may_share_memory(source, target):
        target[...] = source
    if not np.may_share_memory(result, target):
        result[...] = target.reshape(result.shape)
    return result


def _header(
    collective: str, src: np.ndarray, *, algorithm: str, op: str | None = None, root: int | None = None
) -> bytes:
    """What every message of this collective carries; ranks must agree on all of it."""
    words = [collective, f"algorithm={algorithm}", f"dtype={src.dtype}", f"shape={src.shape}"]
    if op is not None:
        words.append(f"op={op}")
    if root is not None:
        words.append(f"root={root}")
    return " ".join(words).encode()


def _done(result: Any) -> Work:
    work = Work()
    work.started_at = work.finished_at = time.perf_counter()
    work.set_running_or_notify_cancel()
    work.set_result(result)
    return work
