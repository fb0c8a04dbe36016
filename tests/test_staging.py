"""`StagedTransport`'s logic with no GPU: a marker array type stands for device memory and the
device runtime's calls are replaced by host copies, over the threads backend as the inner
(host-only) transport. What a GPU adds (real pinned memory, real copies) is in test_gpu.py."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from collectives.backends import device, staged
from collectives.backends.staged import StagedTransport
from collectives.backends.threads import ThreadFabric

HEADER = b"staged test"


class FakeDeviceArray(np.ndarray):
    """Host memory the test's device runtime treats as device memory."""


def on_fake_device(values: Any) -> FakeDeviceArray:
    return np.ascontiguousarray(values).view(FakeDeviceArray)


@pytest.fixture
def fake_runtime(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Device calls replaced by host ones; counts what was copied and allocated."""
    counts = {"copies": 0, "pinned": 0}

    def copy_bytes(target: Any, source: Any, after: Any = ()) -> None:
        counts["copies"] += 1
        np.asarray(target).view(np.uint8)[...] = np.asarray(source).view(np.uint8)

    def alloc_pinned_memory(nbytes: int) -> bytearray:
        counts["pinned"] += 1
        return bytearray(nbytes)

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(alloc_pinned_memory=alloc_pinned_memory))
    monkeypatch.setattr(device, "is_device", lambda buf: isinstance(buf, FakeDeviceArray))
    monkeypatch.setattr(device, "copy_bytes", copy_bytes)
    monkeypatch.setattr(device, "ready_event", lambda buf: None)
    monkeypatch.setattr(device, "cupy", lambda: fake_cupy)
    return counts


def staged_pair() -> tuple[StagedTransport, StagedTransport]:
    fabric = ThreadFabric(["a", "b"])
    return StagedTransport(fabric.endpoint(0)), StagedTransport(fabric.endpoint(1))


def test_device_buffers_travel_through_pinned_buffers_that_are_reused(fake_runtime: dict[str, int]) -> None:
    left, right = staged_pair()
    for round_ in range(3):
        message = on_fake_device(np.arange(1000, dtype=np.float32) + round_)
        inbox = on_fake_device(np.zeros(1000, dtype=np.float32))
        receive = right.irecv(inbox, 0, tag=round_, header=HEADER)
        send = left.isend(message, 1, tag=round_, header=HEADER)
        send.wait(5)
        receive.wait(5)
        np.testing.assert_array_equal(inbox, message)
    assert fake_runtime["copies"] == 6  # one down, one up per message
    assert fake_runtime["pinned"] == 2  # one buffer per side, reused every round


def test_host_buffers_pass_straight_through(fake_runtime: dict[str, int]) -> None:
    left, right = staged_pair()
    inbox = np.zeros(10)
    receive = right.irecv(inbox, 0, tag=1, header=HEADER)
    left.isend(np.ones(10), 1, tag=1, header=HEADER).wait(5)
    receive.wait(5)
    assert inbox.sum() == 10 and fake_runtime == {"copies": 0, "pinned": 0}


def test_a_receive_completes_only_after_its_copy_to_the_device(fake_runtime: dict[str, int]) -> None:
    """`test()` sees the inner receive done and copies before saying so; `wait_any` waits on the
    inner requests."""
    left, right = staged_pair()
    inbox = on_fake_device(np.zeros(4, np.int64))
    receive = right.irecv(inbox, 0, tag=7, header=HEADER)
    assert not receive.test()
    with pytest.raises(TimeoutError):
        right.wait_any([receive], 0.01)
    left.isend(on_fake_device(np.arange(4, dtype=np.int64)), 1, tag=7, header=HEADER).wait(5)
    right.wait_any([receive], 5)
    assert receive.test()
    np.testing.assert_array_equal(inbox, np.arange(4))


def test_a_failed_receive_keeps_its_buffer_and_copies_nothing(fake_runtime: dict[str, int]) -> None:
    """An abort fails the staged receive like any other; the pinned buffer is not reused (the
    inner transport may still hold it) and nothing reaches the device buffer."""
    left, right = staged_pair()
    inbox = on_fake_device(np.full(4, -1.0))
    receive = right.irecv(inbox, 0, tag=3, header=HEADER)
    left.abort(RuntimeError("rank 0 gives up"))
    with pytest.raises(Exception, match="gives up"):
        receive.wait(5)
    assert (inbox == -1).all() and fake_runtime["copies"] == 0
    assert not right._pool._idle  # noqa: SLF001 - the buffer did not go back to the pool


def test_the_pool_keeps_a_bounded_number_of_idle_buffers(fake_runtime: dict[str, int]) -> None:
    pool = staged._PinnedPool()  # noqa: SLF001
    buffers = [pool.take(64) for _ in range(staged.POOL_BUFFERS_PER_SIZE + 3)]
    for buffer in buffers:
        pool.give_back(buffer)
    assert len(pool._idle[64]) == staged.POOL_BUFFERS_PER_SIZE  # noqa: SLF001
