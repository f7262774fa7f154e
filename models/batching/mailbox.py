"""One batched request's tokens on their way from the batcher's worker to the
stream's thread, handed over in batches rather than a token at a time.

The stream turns tokens into audio a chunk at a time (a hop and the look-ahead,
models/synthesis/streaming.py), so a token that arrives mid-hop is of no use to
it until the hop is complete. A woken thread is a GIL hand-over that the
worker's next step waits behind: at eight streams the tokens came two thread
hops each (the worker, an LLM producer thread, the stream's thread), sixteen
wake-ups a step (H100, twenty-ninth run: ~1.5 ms between steps beyond their
host work). Here the worker stamps each token and appends it; the stream says
how many tokens it needs (`want`) and is woken once they are there, or at the
end, or on an error. Nothing is dropped: whatever has arrived is handed out
whenever the stream asks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType

from cosyedge_models.synthesis.token_stream import POLL_S, LlmEnd, TimedToken


class TokenMailbox:
    """The worker `put`s tokens and `finish`es once; the consumer `take`s."""

    def __init__(self, capacity: int, opened: float | None = None) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._capacity = capacity  # the most tokens a request yields (its max_len, plus the prefill's)
        self._tokens: list[int] = []
        self._stamps: list[float] = []  # perf_counter when each was sampled
        self._taken = 0
        self._need = 1  # the token count a waiting consumer waits for
        self._waiting = False
        self._done = False
        self._error: BaseException | None = None
        self._opened = time.perf_counter() if opened is None else opened
        self._end_stamp = 0.0
        self.wakes = 0  # consumer wake-ups the worker issued (tests, diagnostics)

    # --- worker side -------------------------------------------------------------------
    def put(self, token: int, stamp: float) -> None:
        with self._cond:
            if self._done:
                raise RuntimeError("a token after the request's end")
            if len(self._tokens) >= self._capacity:
                raise RuntimeError(f"more than {self._capacity} tokens for one request")
            self._tokens.append(token)
            self._stamps.append(stamp)
            if self._waiting and len(self._tokens) >= self._need:
                self._waiting = False
                self.wakes += 1
                self._cond.notify()

    def finish(self, error: BaseException | None = None) -> bool:
        """The end (error None) or the request's error; whether it took effect (a second call is
        ignored: the first owner wins)."""
        with self._cond:
            if self._done:
                return False
            self._done, self._error, self._end_stamp = True, error, time.perf_counter()
            if self._waiting:
                self._waiting = False
                self.wakes += 1
            self._cond.notify()
            return True

    # --- consumer side -----------------------------------------------------------------
    def want(self, count: int) -> None:
        """The consumer can use tokens once `count` of them (in all) exist: a wait wakes only then."""
        with self._cond:
            self._need = max(1, count)

    @property
    def count(self) -> int:
        with self._cond:
            return len(self._tokens)

    def take(self, timeout_s: float) -> tuple[list[TimedToken], LlmEnd | None, BaseException | None] | None:
        """The tokens not yet taken (at least one, or the end), waiting up to `timeout_s` for the
        wanted count; None when the wait timed out with nothing to hand out. Also returns the
        end's span once the request finished and everything before it was taken, or its error."""
        with self._cond:
            if self._taken == len(self._tokens) and not self._done:
                self._need = max(self._need, self._taken + 1)
                self._waiting = True
                self._cond.wait_for(lambda: self._done or len(self._tokens) >= self._need, timeout_s)
                self._waiting = False
            start = self._taken
            if start == len(self._tokens) and not self._done:
                return None
            self._taken = len(self._tokens)
            stamps = self._stamps
            before = stamps[start - 1] if start else self._opened
            timed = [TimedToken(self._tokens[i], stamps[i - 1] if i else before, stamps[i])
                     for i in range(start, self._taken)]
            if not self._done:
                return timed, None, None
            last = stamps[-1] if stamps else self._opened
            return timed, LlmEnd(last, self._end_stamp), self._error


class BatchedTokens:
    """A token source of the streaming loop (models/synthesis/token_stream.py's `TokenSource`)
    over a batched request's mailbox: no producer thread; `want` sets when its thread wakes."""

    def __init__(self, mailbox: TokenMailbox, cancelled: Callable[[], bool], close: Callable[[], None]) -> None:
        self._mailbox = mailbox
        self._cancelled = cancelled
        self._close = close
        self.end: LlmEnd | None = None

    def want(self, count: int) -> None:
        self._mailbox.want(count)

    def __iter__(self) -> Iterator[TimedToken]:
        while True:
            got = self._mailbox.take(POLL_S)
            if got is None:
                if self._cancelled():
                    return
                continue
            timed, end, error = got
            yield from timed
            if error is not None:
                raise error
            if end is not None:
                self.end = end
                return

    def close(self) -> None:
        self._close()

    def __enter__(self) -> BatchedTokens:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
