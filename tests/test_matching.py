"""The matching engine on its own, without a backend: FIFO per stream, either side first, the
header and size checks and their wording, delivery of the payload, withdrawal and draining."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from collectives.backends.base import LockRequest, PostedRequest
from collectives.backends.errors import MismatchError, PeerLostError
from collectives.backends.matching import (
    Matcher,
    check,
    copy_payload,
    mismatch_error,
    receive_payload,
)

Key = tuple[int, int]


def receive(rank: int = 1, peer: int = 0, tag: int = 7, nbytes: int = 16, header: bytes = b"h") -> PostedRequest:
    return PostedRequest("recv", rank, peer, tag, np.zeros(nbytes, np.uint8), header)


def test_receive_first_is_taken_by_the_message() -> None:
    """A receive that finds no message is posted; the message that comes next takes it."""
    matcher: Matcher[Key, str, str] = Matcher()
    assert matcher.match_receive((0, 7), "receive") is None
    assert matcher.counts() == (1, 0) and matcher.has_receive((0, 7))
    assert matcher.match_message((0, 7), "message") == "receive"
    assert matcher.counts() == (0, 0) and not matcher.has_receive((0, 7))


def test_message_first_waits_as_unexpected_for_its_receive() -> None:
    """A message that finds no receive is held; the receive posted next takes it."""
    matcher: Matcher[Key, str, str] = Matcher()
    assert matcher.match_message((0, 7), "message") is None
    assert matcher.counts() == (0, 1) and not matcher.has_receive((0, 7))
    assert matcher.match_receive((0, 7), "receive") == "message"
    assert matcher.counts() == (0, 0)


@pytest.mark.parametrize("receives_first", [False, True])
def test_fifo_within_a_stream_and_streams_never_mix(receives_first: bool) -> None:
    """The oldest message of a stream goes to its oldest receive, whichever side comes first, and
    another source or tag is another stream."""
    matcher: Matcher[Key, str, str] = Matcher()
    streams = [(0, 5), (0, 6), (2, 5)]
    pairs = []

    def post_receives() -> None:
        for key in streams:
            for index in range(3):
                message = matcher.match_receive(key, f"receive {key} #{index}")
                if message is not None:
                    pairs.append((message, f"receive {key} #{index}"))

    def post_messages() -> None:
        for key in reversed(streams):
            for index in range(3):
                receive = matcher.match_message(key, f"message {key} #{index}")
                if receive is not None:
                    pairs.append((f"message {key} #{index}", receive))

    if receives_first:
        post_receives()
        post_messages()
    else:
        post_messages()
        post_receives()
    assert sorted(pairs) == sorted(
        (f"message {key} #{index}", f"receive {key} #{index}") for key in streams for index in range(3)
    )
    assert matcher.counts() == (0, 0)


def test_many_sources_and_tags_interleaved_match_a_fifo_per_stream() -> None:
    """Random interleavings of receives and messages over many streams pair exactly as one FIFO
    queue per stream would (the rule MPI states): the n-th receive of a stream gets its n-th
    message, and nothing is left behind once every stream is balanced."""
    rng = random.Random(20240611)
    keys = [(source, tag) for source in range(5) for tag in range(4)]
    for _ in range(20):
        matcher: Matcher[Key, tuple[Key, int], tuple[Key, int]] = Matcher()
        posts = [(side, key) for side in ("receive", "message") for key in keys for _ in range(6)]
        rng.shuffle(posts)
        counts = {(side, key): 0 for side, key in posts}
        waiting: dict[tuple[str, Key], deque[int]] = {post: deque() for post in posts}
        for side, key in posts:
            other = "message" if side == "receive" else "receive"
            number = counts[side, key]
            counts[side, key] += 1
            match = matcher.match_receive if side == "receive" else matcher.match_message
            matched = match(key, (key, number))
            if waiting[other, key]:
                assert matched == (key, waiting[other, key].popleft()) == (key, number)
            else:
                assert matched is None
                waiting[side, key].append(number)
        assert matcher.counts() == (0, 0)


def test_halves_of_a_match_for_backends_that_look_before_posting() -> None:
    """take_message/post_receive and take_receive/hold_message are match_receive and match_message
    in two steps."""
    matcher: Matcher[Key, str, str] = Matcher()
    assert matcher.take_message((1, 0)) is None
    matcher.post_receive((1, 0), "r1")
    matcher.post_receive((1, 0), "r2")
    assert matcher.take_receive((1, 0)) == "r1"
    assert matcher.take_receive((1, 0)) == "r2"
    assert matcher.take_receive((1, 0)) is None
    matcher.hold_message((1, 0), "m1")
    matcher.hold_message((1, 0), "m2")
    assert matcher.match_receive((1, 0), "r3") == "m1"
    assert matcher.take_message((1, 0)) == "m2"
    assert matcher.counts() == (0, 0)


def test_withdraw_takes_what_is_picked_and_keeps_the_order_of_the_rest() -> None:
    """Withdrawn entries come back oldest first; the others still match in their order; a kind
    without a predicate is left alone."""
    matcher: Matcher[Key, str, str] = Matcher()
    for name in ("a0", "b0", "a1", "b1", "a2"):
        matcher.match_receive((ord(name[0]), 0), name)
    matcher.match_message((9, 9), "held")
    receives, messages = matcher.withdraw(lambda name: name in ("a0", "a2", "b0", "b1"))
    assert sorted(receives) == ["a0", "a2", "b0", "b1"] and messages == []
    assert receives.index("a0") < receives.index("a2") and receives.index("b0") < receives.index("b1")
    assert matcher.counts() == (1, 1) and not matcher.has_receive((ord("b"), 0))
    assert matcher.match_message((ord("a"), 0), "m") == "a1"
    _, messages = matcher.withdraw(messages=lambda name: True)
    assert messages == ["held"] and matcher.counts() == (0, 0)


def test_drain_empties_the_engine() -> None:
    """drain returns every waiting receive and message, oldest first per stream, and nothing is
    matched afterwards."""
    matcher: Matcher[Key, str, str] = Matcher()
    matcher.match_receive((0, 1), "r0")
    matcher.match_receive((0, 1), "r1")
    matcher.match_message((2, 1), "m0")
    assert matcher.drain() == (["r0", "r1"], ["m0"])
    assert matcher.counts() == (0, 0)
    assert matcher.match_message((0, 1), "late") is None  # held now, not given to a drained receive


def test_check_accepts_the_expected_header_and_size() -> None:
    assert check(receive(nbytes=16, header=b"allreduce"), b"allreduce", 16) is None


def test_header_mismatch_names_both_headers_and_both_ranks() -> None:
    """One error, given to both sides of the pair, quotes what each side had."""
    error = check(receive(rank=1, peer=0, header=b"allreduce shape=(3,)"), b"allreduce shape=(4,)", 16)
    assert isinstance(error, MismatchError)
    assert str(error) == "rank 1 expected from rank 0: allreduce shape=(3,); rank 0 sent: allreduce shape=(4,)"


def test_header_mismatch_is_reported_before_a_size_mismatch() -> None:
    """Different collectives usually move different sizes too: the headers say more."""
    error = check(receive(nbytes=16, header=b"barrier"), b"allreduce", 4000)
    assert error is not None and "barrier" in str(error) and "allreduce" in str(error) and "4000" not in str(error)


def test_size_mismatch_names_both_sizes_ranks_and_tag() -> None:
    error = check(receive(rank=3, peer=2, tag=41, nbytes=4000), b"h", 4004)
    assert isinstance(error, MismatchError)
    assert str(error) == "rank 3 expected 4000 bytes from rank 2 (tag 41), rank 2 sent 4004 bytes"


def test_mismatch_text_survives_headers_that_are_not_text() -> None:
    """A garbled header is shown with replacement characters rather than failing to decode."""
    error = mismatch_error(0, 1, 2, b"\xff\xfeexpected", 8, b"sent\x80", 8)
    assert "\ufffd" in str(error) and "expected" in str(error) and "sent" in str(error)


def test_copy_payload_copies_values_or_raw_bytes() -> None:
    """Same dtype: a real copy of the values; another dtype of equal byte size: the raw bytes."""
    target = np.zeros(3)
    source = np.array([1.0, 2.0, 3.0])
    copy_payload(target, source)
    np.testing.assert_array_equal(target, source)
    source[0] = -1  # a copy, not a view
    assert target[0] == 1.0
    raw = np.zeros(2, np.int32)
    floats = np.array([1.5, -2.0], np.float32)
    copy_payload(raw, floats)
    assert raw.tobytes() == floats.tobytes()


def test_receive_payload_copies_into_the_buffer() -> None:
    out = np.zeros(4, np.float32)
    request = LockRequest("recv", 1, 0, 3, out, b"h")
    assert receive_payload(request, np.arange(4, dtype=np.float32)) is None
    np.testing.assert_array_equal(out, [0, 1, 2, 3])


def test_receive_payload_hands_the_message_to_the_reduction() -> None:
    """With `consume`, the message is given to it and the buffer (which only gives the size) is
    left alone."""
    seen = []
    buf = np.zeros(2)
    request = LockRequest("recv", 1, 0, 3, buf, b"h", consume=lambda message: seen.append(message.copy()))
    assert receive_payload(request, np.array([5.0, 6.0])) is None
    np.testing.assert_array_equal(seen[0], [5.0, 6.0])
    assert not buf.any()


def test_a_failing_reduction_fails_the_receive_naming_both_ranks_and_the_cause() -> None:
    def explode(message: np.ndarray) -> None:
        raise ValueError("disk on fire")

    request = LockRequest("recv", 2, 5, 3, np.zeros(2), b"h", consume=explode)
    error = receive_payload(request, np.ones(2))
    assert isinstance(error, PeerLostError)
    assert "rank 2" in str(error) and "rank 5" in str(error) and "disk on fire" in str(error)


def test_posted_request_keeps_its_size_after_the_buffer_is_dropped() -> None:
    """A completed request drops its buffer (the caller's again) but can still be reported."""
    request = LockRequest("send", 0, 1, 9, np.zeros(5, np.float64), b"h")
    request._finish()
    assert request.buf is None and request.nbytes == 40 and request.test()
