"""Speech tokens for the engine's consumer side (flow + vocoder), timed, from
either the request's own thread (serial) or an LLM producer thread that runs
the decode loop ahead while the consumer turns the previous chunk into audio
(stage overlap, DESIGN.md "Data flow"); a batched request's tokens come from
the batcher's worker (models/batching/mailbox.py, no producer thread).

Every source is a `TokenSource`: a context manager yielding `TimedToken`s; leaving the `with`
block (end of stream, an error, a cancel, or the consumer generator being
closed) stops the producer and closes the LLM generator, which frees its
decode loop (KV cache) on the thread that ran it."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from cosyedge_models.errors import SynthesisError

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often blocked queue calls look at cancel/stop (bounds the reaction time)
STOP_WAIT_S = 30.0  # a producer finishes its current LLM step, then stops; longer means a hung backend


@dataclass(frozen=True)
class TimedToken:
    token: int
    start: float  # perf_counter when the LLM began on it (prefill and skipped fill tokens included)
    end: float  # perf_counter when it was sampled


@dataclass(frozen=True)
class LlmEnd:
    """The LLM finished (EOS or the maximum length): the span of its last step."""

    start: float
    end: float


@dataclass(frozen=True)
class _Failed:
    error: Exception


_Item = TimedToken | LlmEnd | _Failed


class TokenSource(Protocol):
    """What the streaming loop reads a segment's tokens from."""

    end: LlmEnd | None  # set once the LLM finished and every token was read

    def __iter__(self) -> Iterator[TimedToken]: ...

    def want(self, count: int) -> None:
        """The loop can use tokens once `count` of the segment's exist (the next chunk's): a source
        that hands them over from another thread need not wake it before."""

    def close(self) -> None: ...

    def __enter__(self) -> TokenSource: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...


def close_tokens(tokens: Iterator[int]) -> None:
    """Close the LLM's token iterator if it can be (a generator: its `finally`
    releases the decode loop); plain iterators hold nothing."""
    close = getattr(tokens, "close", None)
    if callable(close):
        close()


class SerialTokens:
    """Tokens pulled on the consumer's thread: the LLM waits while the consumer works."""

    def __init__(self, tokens: Iterator[int]) -> None:
        self._tokens = tokens
        self.end: LlmEnd | None = None

    def __iter__(self) -> Iterator[TimedToken]:
        while True:
            t0 = time.perf_counter()
            try:
                token = next(self._tokens)
            except StopIteration:
                self.end = LlmEnd(t0, time.perf_counter())
                return
            yield TimedToken(token, t0, time.perf_counter())

    def want(self, count: int) -> None:
        """Pulled one at a time on this thread: nothing to wait for."""

    def close(self) -> None:
        close_tokens(self._tokens)

    def __enter__(self) -> SerialTokens:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class ProducedTokens:
    """One segment's tokens, produced on a `ProducerPool` thread into a bounded
    queue (the LLM runs at most `queue_tokens` ahead of the consumer). An
    exception on the producer is raised again, as the same object, where the
    consumer iterates."""

    def __init__(self, tokens: Iterator[int], cancelled: Callable[[], bool], queue_tokens: int) -> None:
        self._tokens = tokens
        self._cancelled = cancelled
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=queue_tokens)
        self._stop = threading.Event()
        self._done = threading.Event()
        self.end: LlmEnd | None = None

    # --- producer side (a pool thread) --------------------------------------------------
    def _stopping(self) -> bool:
        return self._stop.is_set() or self._cancelled()

    def _put(self, item: _Item) -> bool:
        while not self._stopping():
            try:
                self._queue.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce(self) -> None:
        try:
            while not self._stopping():
                t0 = time.perf_counter()
                try:
                    token = next(self._tokens)
                except StopIteration:
                    self._put(LlmEnd(t0, time.perf_counter()))
                    return
                if not self._put(TimedToken(token, t0, time.perf_counter())):
                    return
        except Exception as exc:  # handed to the consumer, which raises it
            self._put(_Failed(exc))
        finally:
            try:
                close_tokens(self._tokens)  # the decode loop is released on the thread that used it
            finally:
                self._done.set()

    def stop(self) -> None:
        """Ask the producer to stop after its current LLM step (does not wait)."""
        self._stop.set()

    def abandon(self) -> None:
        """The pool will not run this job (it is stopping)."""
        self._stop.set()
        close_tokens(self._tokens)
        self._done.set()

    # --- consumer side -----------------------------------------------------------------
    def want(self, count: int) -> None:
        """The producer paces itself by the queue's bound (the LLM's own loop); each token is handed over."""

    def __iter__(self) -> Iterator[TimedToken]:
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if self._cancelled():
                    return
                # done is set after the producer's last put: an empty queue then is final.
                if self._done.is_set() and self._queue.empty():
                    # Without LlmEnd: stopped from outside (the engine closed mid-request);
                    # the audio would be cut short, so say so.
                    raise SynthesisError(
                        "the LLM stopped before the end of the speech (was the engine closed?)") from None
                continue
            if isinstance(item, TimedToken):
                yield item
            elif isinstance(item, LlmEnd):
                self.end = item
                return
            else:
                raise item.error

    def close(self) -> None:
        """Stop the producer and wait until it has let go of the LLM."""
        self.stop()
        if not self._done.wait(STOP_WAIT_S):
            log.warning("the LLM producer did not stop within %.0f s (a hung backend call?)", STOP_WAIT_S)
        while not self._queue.empty():  # nothing holds the tokens any more
            self._queue.get_nowait()

    def __enter__(self) -> ProducedTokens:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class ProducerPool:
    """The LLM producer threads of one engine, grown on demand up to
    `max_threads` and kept until `stop()`. Long-lived rather than one thread
    per request because GPU backends keep per-thread state (TensorRT: an
    execution context, stream and buffers per thread and session, freed only
    when the session closes): reused threads bound it by the peak number of
    concurrent streams. Jobs beyond `max_threads` wait in a bounded queue."""

    def __init__(self, max_threads: int, max_pending: int = 64, name: str = "cosyedge-llm") -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.name = name
        self._jobs: queue.Queue[ProducedTokens | None] = queue.Queue(maxsize=max_pending)
        self._threads: list[threading.Thread] = []
        self._active: set[ProducedTokens] = set()
        # Counted at submit, not when a thread wakes: a thread that has taken a job but not yet said
        # so must not count as free, or a job arriving then spawns no thread and waits for another
        # stream's whole segment (H100, twenty-second run: one of eight streams ~470 ms late).
        self._idle = 0  # threads waiting for a job that no queued job is meant for
        self._backlog = 0  # queued jobs that no thread is meant for yet (max_threads reached)
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> ProducerPool:
        """Start the first producer thread now, so the first request does not pay for it."""
        with self._lock:
            if self._closed:
                raise SynthesisError("the engine is closed")
            if not self._threads:
                self._spawn()
        return self

    def _spawn(self, idle: bool = True) -> None:  # with the lock held; idle=False: for the job being queued
        thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
        self._threads.append(thread)
        self._idle += int(idle)
        thread.start()

    def submit(self, job: ProducedTokens) -> ProducedTokens:
        with self._lock:
            if self._closed:
                job.abandon()
                raise SynthesisError("the engine is closed")
            self._active.add(job)
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                self._active.discard(job)
                job.abandon()
                raise SynthesisError("too many streaming requests are waiting for the LLM; "
                                  "try again later or raise SynthesisSettings.producer_threads") from None
            if self._idle > 0:
                self._idle -= 1  # a waiting thread takes it
            elif len(self._threads) < self.max_threads:
                self._spawn(idle=False)
            else:
                self._backlog += 1  # the next thread to finish a job takes it
        return job

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.produce()
            except BaseException:  # produce() hands errors on; this is a bug, not a request's error
                log.exception("LLM producer failed")
            finally:
                with self._lock:
                    self._active.discard(job)
                    if self._backlog > 0:
                        self._backlog -= 1  # this thread takes a queued job next
                    else:
                        self._idle += 1

    @property
    def threads(self) -> int:
        with self._lock:
            return sum(t.is_alive() for t in self._threads)

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Stop every job and thread; waits for the threads to exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            active, threads = list(self._active), list(self._threads)
        for job in active:
            job.stop()
        for _ in threads:
            self._jobs.put(None)  # behind any pending jobs, which see their stop flag and end at once
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("LLM producer thread %s did not stop within %.0f s", t.name, timeout)
