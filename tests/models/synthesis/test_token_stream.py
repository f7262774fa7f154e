"""The LLM producer pool on plain generators: order, errors handed over as
the same object, backpressure, cancel, and stopping."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from cosyedge_models.errors import SynthesisError
from cosyedge_models.synthesis.token_stream import ProducedTokens, ProducerPool, SerialTokens


def counting(n: int, delay: float = 0.0, closed: threading.Event | None = None) -> Iterator[int]:
    try:
        for i in range(n):
            time.sleep(delay)
            yield i
    finally:
        if closed is not None:
            closed.set()


@pytest.fixture()
def pool() -> Iterator[ProducerPool]:
    p = ProducerPool(max_threads=2, max_pending=2, name="test-llm")
    p.start()
    yield p
    p.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-llm")]


def never() -> bool:
    return False


def test_tokens_arrive_in_order_with_the_end(pool: ProducerPool) -> None:
    closed = threading.Event()
    with pool.submit(ProducedTokens(counting(50, closed=closed), never, queue_tokens=4)) as source:
        got = [t.token for t in source]
        assert source.end is not None and source.end.start <= source.end.end
    assert got == list(range(50)) and closed.is_set()
    serial = SerialTokens(counting(5))
    assert [t.token for t in serial] == list(range(5)) and serial.end is not None


def test_an_error_reaches_the_consumer_as_the_same_object(pool: ProducerPool) -> None:
    boom = ValueError("boom")
    closed = threading.Event()

    def failing() -> Iterator[int]:
        try:
            yield 0
            yield 1
            raise boom
        finally:
            closed.set()

    got = []
    source = pool.submit(ProducedTokens(failing(), never, queue_tokens=4))
    with pytest.raises(ValueError) as err, source:
        for t in source:
            got.append(t.token)
    assert err.value is boom and got == [0, 1] and closed.is_set()


def test_a_full_queue_holds_the_producer_back_and_close_releases_it(pool: ProducerPool) -> None:
    closed = threading.Event()
    source = pool.submit(ProducedTokens(counting(1000, closed=closed), never, queue_tokens=3))
    it = iter(source)
    assert next(it).token == 0
    time.sleep(0.1)
    assert not closed.is_set()  # blocked on the full queue, not finished
    source.close()
    assert closed.is_set()


def test_cancel_stops_a_producer_the_consumer_is_not_reading(pool: ProducerPool) -> None:
    cancel = threading.Event()
    closed = threading.Event()
    source = pool.submit(ProducedTokens(counting(1000, delay=0.005, closed=closed), cancel.is_set, queue_tokens=500))
    time.sleep(0.05)
    cancel.set()
    assert closed.wait(1.0)
    assert [t.token for t in source][-1] < 999  # the consumer ends without error, early
    source.close()


def test_jobs_beyond_the_threads_wait_and_beyond_the_queue_are_refused() -> None:
    pool = ProducerPool(max_threads=1, max_pending=1, name="test-llm")
    try:
        first = pool.submit(ProducedTokens(counting(1000), never, queue_tokens=1))  # occupies the only thread
        time.sleep(0.05)
        second = pool.submit(ProducedTokens(counting(3), never, queue_tokens=8))  # waits in the queue
        with pytest.raises(SynthesisError, match="too many streaming requests"):
            pool.submit(ProducedTokens(counting(3), never, queue_tokens=8))
        first.close()
        with second:
            assert [t.token for t in second] == [0, 1, 2]
        assert pool.threads == 1
    finally:
        pool.stop()
    with pytest.raises(SynthesisError, match="closed"):
        pool.submit(ProducedTokens(counting(3), never, queue_tokens=8))
