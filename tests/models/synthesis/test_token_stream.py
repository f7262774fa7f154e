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


def _blocking(started: threading.Event, release: threading.Event) -> Iterator[int]:
    started.set()  # the job's producer began (its first next())
    release.wait(5.0)
    yield 0


def _late_jobs(streams: int) -> list[int]:
    """One round: a pool with idle threads (as after a bench level), `streams` jobs submitted at once from
    their own threads, each blocking in its first token; the jobs that had not begun within 2 s."""
    pool = ProducerPool(max_threads=16, max_pending=16, name="test-llm")
    release = threading.Event()
    jobs: list[ProducedTokens] = []
    starts = [threading.Event() for _ in range(streams)]
    gate = threading.Barrier(streams)

    def arrive(started: threading.Event) -> None:
        gate.wait()
        jobs.append(pool.submit(ProducedTokens(_blocking(started, release), never, queue_tokens=4)))

    try:
        pool.start()
        with pool.submit(ProducedTokens(counting(2), never, queue_tokens=4)) as warm:
            assert [t.token for t in warm] == [0, 1]
        callers = [threading.Thread(target=arrive, args=(s,)) for s in starts]
        for c in callers:
            c.start()
        for c in callers:
            c.join()
        deadline = time.monotonic() + 2.0
        late = [i for i, s in enumerate(starts) if not s.wait(max(0.0, deadline - time.monotonic()))]
        assert pool.threads <= streams + 1
        return late
    finally:
        release.set()
        for job in jobs:
            job.close()
        pool.stop()


def test_every_job_within_the_threads_starts_at_once_when_many_arrive_together() -> None:
    # A pool counted a thread that had taken a job but not yet said so as idle, so a job arriving then
    # spawned no thread and waited for a whole segment of another stream (H100, twenty-second run: the
    # slowest of eight streams began pulling its tokens at 524 ms, all of them already decoded).
    for _ in range(25):
        assert _late_jobs(8) == []
