"""A batched request's mailbox (models/batching/mailbox.py): the stream's thread is
woken once the tokens it wants are in, or at the end, or on an error, and
never loses a token; each token keeps the stamps the streaming loop times."""

from __future__ import annotations

import threading
import time

import pytest
from cosyedge_models.batching.mailbox import BatchedTokens, TokenMailbox
from cosyedge_models.errors import SynthesisError
from cosyedge_models.synthesis.token_stream import TimedToken
from hypothesis import given
from hypothesis import strategies as st


def _waiting_taker(want: int) -> tuple[TokenMailbox, threading.Thread, list]:
    """A mailbox (opened at 1.0) and a consumer thread waiting in it for `want` tokens; what it took."""
    box = TokenMailbox(capacity=10, opened=1.0)
    box.want(want)
    got: list = []
    t = threading.Thread(target=lambda: got.append(box.take(10.0)))
    t.start()
    deadline = time.monotonic() + 10
    while not box._waiting:  # the consumer is inside its wait (test-only peek)
        assert time.monotonic() < deadline, "the consumer never waited"
        time.sleep(0.001)
    return box, t, got


def test_a_waiting_consumer_is_woken_once_when_its_wanted_tokens_are_in() -> None:
    box, t, got = _waiting_taker(4)
    for i in range(3):
        box.put(100 + i, 2.0 + i)
    time.sleep(0.05)
    assert t.is_alive() and not got and box.wakes == 0  # three of four: still asleep
    box.put(103, 5.0)
    t.join(10)
    timed, end, error = got[0]
    assert [x.token for x in timed] == [100, 101, 102, 103] and end is None and error is None
    assert timed[0] == TimedToken(100, 1.0, 2.0) and timed[3] == TimedToken(103, 4.0, 5.0)
    assert box.wakes == 1


def test_tokens_already_in_are_handed_out_at_once_below_the_wanted_count() -> None:
    box = TokenMailbox(capacity=10, opened=1.0)
    box.want(8)
    box.put(7, 2.0)
    box.put(8, 3.0)
    timed, end, _ = box.take(0.0) or ([], None, None)
    assert [x.token for x in timed] == [7, 8] and end is None and box.wakes == 0
    assert box.take(0.01) is None  # nothing new: a timed-out wait hands out nothing
    box.put(9, 4.0)
    timed, _, _ = box.take(0.0) or ([], None, None)
    assert timed == [TimedToken(9, 3.0, 4.0)]  # its start is the token before's stamp


def test_the_end_wakes_a_consumer_short_of_its_wanted_count_with_every_token() -> None:
    box, t, got = _waiting_taker(9)
    box.put(1, 2.0)
    assert box.finish()
    t.join(10)
    timed, end, error = got[0]
    assert [x.token for x in timed] == [1] and error is None
    assert end is not None and end.start == 2.0 and end.end >= end.start
    assert box.wakes == 1
    assert not box.finish(SynthesisError("late"))  # the first owner wins
    assert box.take(0.0) == ([], end, None)


def test_an_error_reaches_the_consumer_as_the_same_object_after_the_tokens_before_it() -> None:
    box = TokenMailbox(capacity=10)
    err = SynthesisError("LLM batched step failed")
    box.put(5, time.perf_counter())
    box.finish(err)
    source = BatchedTokens(box, lambda: False, lambda: None)
    seen: list[int] = []
    with pytest.raises(SynthesisError) as raised:
        for timed in source:
            seen.append(timed.token)
    assert raised.value is err and seen == [5]


def test_a_token_after_the_end_or_past_the_capacity_is_refused() -> None:
    box = TokenMailbox(capacity=2)
    box.put(1, 1.0)
    box.put(2, 2.0)
    with pytest.raises(RuntimeError, match="more than 2 tokens"):
        box.put(3, 3.0)
    box.finish()
    with pytest.raises(RuntimeError, match="after the request's end"):
        box.put(4, 4.0)


def test_the_source_stops_on_cancel_while_it_waits_and_closes_its_stream() -> None:
    box = TokenMailbox(capacity=10)
    cancelled = threading.Event()
    closed: list[bool] = []
    source = BatchedTokens(box, cancelled.is_set, lambda: closed.append(True))
    threading.Timer(0.05, cancelled.set).start()
    with source:
        assert list(source) == []
    assert closed == [True] and source.end is None


@given(st.lists(st.one_of(st.tuples(st.just("put"), st.integers(1, 5)), st.tuples(st.just("want"), st.integers(0, 40)),
                          st.tuples(st.just("take"), st.just(0))), max_size=40),
       st.booleans())
def test_every_token_is_handed_over_once_in_order_whatever_the_calls(ops: list[tuple[str, int]],
                                                                      error: bool) -> None:
    box = TokenMailbox(capacity=10_000, opened=0.0)
    put: list[int] = []
    taken: list[TimedToken] = []
    for op, n in ops:
        if op == "put":
            for _ in range(n):
                put.append(len(put))
                box.put(put[-1], float(len(put)))
        elif op == "want":
            box.want(n)
        elif (got := box.take(0.0)) is not None:
            taken += got[0]
    failure = SynthesisError("late") if error else None
    box.finish(failure)
    last = box.take(0.0)
    assert last is not None
    rest, end, err = last
    taken += rest
    assert [t.token for t in taken] == put  # each once, in order
    assert all(t.start == float(t.token) and t.end == float(t.token + 1) for t in taken)  # stamps kept
    assert end is not None and err is failure and box.wakes == 0  # no consumer ever waited
