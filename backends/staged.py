"""Device buffers over a host-only transport (MPI, gRPC), through pinned host memory.

The PyPI MPICH is not CUDA-aware and gRPC serialises host bytes, so a CuPy buffer cannot be
handed to either (they refuse it: `base.check_host_buffer`). `StagedTransport` wraps such a
transport: host buffers pass straight through, untouched and at no cost but one type check (fused
receive-reductions included); a device buffer is sent from, or received into, a pinned host
buffer of its size:

* send: the device-to-host copy has finished (after the kernels that wrote the buffer) before
  the inner transport's send is posted;
* receive: the inner transport receives into the pinned buffer; the request reports completion
  (`wait`, `test`) only after the host-to-device copy has finished on the GPU (for a fused
  receive-reduction, the copy to device scratch and the reduction's kernels).

Pinned buffers come from a pool keyed by byte size and go back to it when their request
completes; a request that never completes (a timeout, an abort) keeps its buffer, since the inner
transport may still write into it. At most `POOL_BUFFERS_PER_SIZE` idle buffers of one size are
kept. Pinned memory makes the copies run at full PCIe speed and lets MPI and gRPC read it like any
host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import device
from .base import Buffer, Consume, Request, Transport

POOL_BUFFERS_PER_SIZE = 8
"""Idle pinned buffers kept per byte size (a pipelined collective keeps a few segments in flight)."""


class _PinnedPool:
    """Pinned host buffers (uint8 numpy arrays over page-locked memory), reused by byte size."""

    def __init__(self) -> None:
        self._idle: dict[int, list[np.ndarray]] = {}

    def take(self, nbytes: int) -> np.ndarray:
        idle = self._idle.get(nbytes)
        if idle:
            return idle.pop()
        memory = device.cupy().cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(memory, dtype=np.uint8, count=nbytes)  # the array keeps `memory` alive

    def give_back(self, buffer: np.ndarray) -> None:
        idle = self._idle.setdefault(buffer.nbytes, [])
        if len(idle) < POOL_BUFFERS_PER_SIZE:
            idle.append(buffer)


class _StagedRequest:
    """A request of the inner transport on a pinned buffer. A receive's delivery (the copy to the
    device buffer, or to device scratch handed to `consume`) runs once, when the inner request is
    first seen complete without error; then the pinned buffer goes back to the pool."""

    __slots__ = ("inner", "_pinned", "_device_buffer", "_consume", "_pool", "_done")

    def __init__(
        self,
        inner: Request,
        pinned: np.ndarray,
        device_buffer: Buffer | None,
        pool: _PinnedPool,
        consume: Consume | None = None,
    ) -> None:
        self.inner = inner
        self._pinned = pinned
        self._device_buffer = device_buffer
        self._consume = consume
        self._pool = pool
        self._done = False

    def wait(self, timeout: float | None) -> None:
        self.inner.wait(timeout)  # raises TimeoutError or the collective error: nothing to deliver
        self._complete()

    def test(self) -> bool:
        if not self.inner.test():
            return False
        try:
            self.inner.wait(0)
        except BaseException:  # noqa: BLE001 - `wait` raises it to the caller
            return True
        self._complete()
        return True

    def _complete(self) -> None:
        if self._done:
            return
        self._done = True
        target, consume = self._device_buffer, self._consume
        self._device_buffer = self._consume = None
        if target is not None and consume is None:
            device.copy_bytes(target, self._pinned)
        elif target is not None and consume is not None:
            scratch = device.scratch_like(target)
            device.copy_bytes(scratch, self._pinned)
            with scratch.device:
                consume(scratch)
                device.synchronize(scratch)
        self._pool.give_back(self._pinned)


class StagedTransport(Transport):
    """`inner` (a host-only transport) that also moves device buffers, staged through pinned
    host memory. Everything but `isend`, `irecv` and `native_allreduce` of device buffers is the
    inner transport's."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.size = inner.size
        self._pool = _PinnedPool()
        self.has_native_allreduce = inner.has_native_allreduce
        self.native_dtypes = inner.native_dtypes
        self.agrees_natively = inner.agrees_natively
        self.duplicable = inner.duplicable
        self.fuses_receive_reduce = inner.fuses_receive_reduce

    @property
    def host(self) -> str:
        return self.inner.host

    @host.setter
    def host(self, name: str) -> None:
        self.inner.host = name

    def isend(self, buf: Buffer, dst: int, tag: int, header: bytes) -> Request:
        if not device.is_device(buf):
            return self.inner.isend(buf, dst, tag, header)
        pinned = self._pool.take(buf.nbytes)
        device.copy_bytes(pinned, buf, (device.ready_event(buf),))
        return _StagedRequest(self.inner.isend(pinned.view(buf.dtype), dst, tag, header), pinned, None, self._pool)

    def irecv(self, buf: Buffer, src: int, tag: int, header: bytes) -> Request:
        if not device.is_device(buf):
            return self.inner.irecv(buf, src, tag, header)
        pinned = self._pool.take(buf.nbytes)
        request = self.inner.irecv(pinned.view(buf.dtype), src, tag, header)
        return _StagedRequest(request, pinned, buf, self._pool)

    def irecv_reduce(self, buf: Buffer, src: int, tag: int, header: bytes, consume: Consume) -> Request:
        if not device.is_device(buf):
            return self.inner.irecv_reduce(buf, src, tag, header, consume)
        pinned = self._pool.take(buf.nbytes)
        request = self.inner.irecv(pinned.view(buf.dtype), src, tag, header)
        return _StagedRequest(request, pinned, buf, self._pool, consume)

    def wait_any(self, requests: Sequence[Request], timeout: float) -> None:
        inner = [request.inner if isinstance(request, _StagedRequest) else request for request in requests]
        self.inner.wait_any(inner, timeout)

    def native_allreduce(self, src: Buffer, dst: Buffer, op: str, timeout: float | None = None, tag: int = 0) -> None:
        if not (device.is_device(src) or device.is_device(dst)):
            self.inner.native_allreduce(src, dst, op, timeout=timeout, tag=tag)
            return
        host_src = self._pool.take(src.nbytes)
        host_dst = self._pool.take(dst.nbytes)
        device.copy_bytes(host_src, src, (device.ready_event(src),))
        self.inner.native_allreduce(host_src.view(src.dtype), host_dst.view(dst.dtype), op, timeout=timeout, tag=tag)
        device.copy_bytes(dst, host_dst)
        self._pool.give_back(host_src)
        self._pool.give_back(host_dst)

    def start_agreement(self, digest: np.ndarray, result: np.ndarray, tag: int) -> Request:
        return self.inner.start_agreement(digest, result, tag)

    def gather_headers(self, header: bytes, tag: int, timeout: float) -> list[bytes]:
        return self.inner.gather_headers(header, tag, timeout)

    def announce_waiting(self, tag: int) -> None:
        self.inner.announce_waiting(tag)

    def waiting_ranks(self, tag: int) -> set[int]:
        return self.inner.waiting_ranks(tag)

    def empty(self, count: int, dtype: Any) -> Buffer:
        return self.inner.empty(count, dtype)

    def clock(self) -> float:
        return self.inner.clock()

    def dup(self, key: int) -> StagedTransport:
        return StagedTransport(self.inner.dup(key))

    def abort(self, error: BaseException, since_tag: int | None = None) -> None:
        self.inner.abort(error, since_tag)

    def close(self) -> None:
        self.inner.close()
