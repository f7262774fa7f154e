"""Continuous batching of the LLM across requests: one worker thread owns the
batched decode (models/batching/kv.py) and runs, round after round, (1) drop
cancelled requests, (2) admit waiting requests (models/batching/policy.py),
prefill each alone and add its cache to the batch, (3) one decode step for
every active request. Each request's tokens go to its own mailbox
(models/batching/mailbox.py); its `generate` iterator reads them. Sampling
and the length/EOS/fill rules are per request (`RequestDecode`, shared with
the unbatched path), so a seeded request yields the same tokens alone or in
a batch.

`run_once` is one round; the worker calls it in a loop, tests call it
directly to place joins and leaves at chosen steps."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import numpy as np
from cosyedge_models.backends.profiles import stage_profiles
from cosyedge_models.batching.group import GroupGate, RequestGroup
from cosyedge_models.batching.kv import BatchDecoder
from cosyedge_models.batching.mailbox import BatchedTokens, TokenMailbox
from cosyedge_models.batching.policy import BatchSettings, Waiting, admit
from cosyedge_models.batching.worker import BatchWorker
from cosyedge_models.bundle.loader import Bundle
from cosyedge_models.errors import BundleError, SynthesisError
from cosyedge_models.synthesis.llm import LlmInput, LlmStats, RequestDecode, SpeechTokenLM, accept_rows
from cosyedge_models.synthesis.sampling import TokenSampler

log = logging.getLogger(__name__)



@dataclass(eq=False)
class _Request:
    key: int
    priority: int
    arrived: float
    decode: RequestDecode
    cancel: threading.Event | None
    # the tokens before its stream's first audio (its first chunk's): until they are sampled its steps are
    # first-audio work (GraphBatcher: not held by another stream's first chunk); 0: none
    first_tokens: int = 0
    closed: threading.Event = field(default_factory=threading.Event)  # the consumer went away
    # Never blocks the worker: a request yields at most max_len tokens (and the prefill's one).
    out: TokenMailbox = field(init=False)

    def __post_init__(self) -> None:
        self.out = TokenMailbox(self.decode.max_len + 1)

    def cancelled(self) -> bool:
        return self.closed.is_set() or (self.cancel is not None and self.cancel.is_set())

    def waiting(self) -> Waiting:
        return Waiting(self.key, self.priority, self.arrived)

    def end(self, stats: BatchStats, error: BaseException | None = None) -> None:
        """Its end (error None) or its error to the consumer, once; its tokens and wake-ups counted."""
        if self.out.finish(error):
            stats.handed_tokens += self.out.count
            stats.handovers += self.out.wakes


@dataclass
class BatchStats:
    """Counters of the batched decode (written by the worker only): how often
    requests really shared a step, for tests and diagnostics."""

    steps: int = 0  # decode steps run
    shared_steps: int = 0  # of them, steps with more than one request in the batch
    peak_batch: int = 0  # the most requests in one step
    unbatched: int = 0  # requests too long for the batched step, run on the ordinary loop (GraphBatcher)
    # GraphBatcher's time (bench: where a token's time goes): the rounds' prefills (wall, what the running
    # streams waited for), the steps' calls on the graph thread (queue, replay, the hops there and back) and
    # the rest of the steps on the batcher's thread (inputs, sampling, handing the tokens out)
    prefill_s: float = 0.0
    step_call_s: float = 0.0
    step_host_s: float = 0.0
    batched_prefills: int = 0  # GraphBatcher: prefill runs that served several streams (llm_batched_prefill)
    captured_prefills: int = 0  # GraphBatcher: prompts prefilled through captured graphs (llm_captured_prefill)
    # tokens handed to the streams and the wake-ups that took them there (models/batching/mailbox.py): a
    # stream is woken when its next chunk's tokens are in, not a token at a time (counted as requests leave)
    handed_tokens: int = 0
    handovers: int = 0


class TokenStream:
    """The consumer side of one batched request: iterate for tokens; close()
    (or leaving a for loop early and dropping it) frees its batch row. The
    streaming loop reads it through `timed()` (models/batching/mailbox.py)."""

    def __init__(self, batcher: BatchWorker, request: _Request) -> None:
        self._batcher = batcher
        self._request = request

    def __iter__(self) -> Iterator[int]:
        try:
            with self.timed() as source:
                for timed in source:
                    yield timed.token
        finally:
            self.close()

    def timed(self) -> BatchedTokens:
        """The stamped tokens, handed over in batches of the count the consumer `want`s."""
        return BatchedTokens(self._request.out, self._request.cancelled, self.close)

    def close(self) -> None:
        if not self._request.closed.is_set():
            self._request.closed.set()
            self._batcher.kick()


class LlmBatcher(BatchWorker):
    def __init__(self, lm: SpeechTokenLM, settings: BatchSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("llm-batcher", clock)
        self.lm = lm
        self.settings = settings
        self.decoder = BatchDecoder(lm.prefill_session, lm.decode_session,
                                    compact_min_columns=settings.compact_min_columns)
        self.delay_ms: float | None = None  # None: settings.max_queue_delay_ms
        self.stats = BatchStats()
        self._keys = itertools.count()
        self._waiting: list[_Request] = []
        self._active: dict[int, _Request] = {}  # worker-owned
        self.groups = GroupGate(self.clock, self.kick)  # open groups hold admission back

    # --- lifecycle (start/stop: BatchWorker) -------------------------------------------
    def _stopped(self) -> None:
        self._fail_all(SynthesisError("the LLM batcher stopped before the request finished"))

    def _round_failed(self, exc: Exception) -> None:
        # Fail the batch rather than leave its consumers waiting.
        self._fail_active(_as_engine_error(exc, "LLM batcher round failed"))

    # --- consumer side -----------------------------------------------------------------
    def submit(self, inp: LlmInput, sampler: TokenSampler, stats: LlmStats | None = None, *,
               priority: int = 0, cancel: threading.Event | None = None, first_tokens: int = 0) -> TokenStream:
        request = _Request(next(self._keys), priority, self.clock(),
                           self.lm.start(inp, sampler, stats), cancel, first_tokens)
        with self._cond:
            if self._stopping:
                raise SynthesisError("the LLM batcher is stopped")
            if len(self._waiting) >= self.settings.max_queue_size:
                raise SynthesisError(f"the LLM batcher's queue is full ({len(self._waiting)} requests wait to join; "
                                  f"max_queue_size is {self.settings.max_queue_size})")
            self._waiting.append(request)
            self._kick()
        return TokenStream(self, request)

    def generate(self, inp: LlmInput, sampler: TokenSampler, stats: LlmStats | None = None, *,
                 priority: int = 0, cancel: threading.Event | None = None, first_tokens: int = 0) -> Iterator[int]:
        """Like `SpeechTokenLM.generate`, with the decode steps shared with the other active requests
        (`first_tokens`: kept with the request; this batcher's steps are not on a graph thread)."""
        return iter(self.open(inp, sampler, stats, priority=priority, cancel=cancel, first_tokens=first_tokens))

    def open(self, inp: LlmInput, sampler: TokenSampler, stats: LlmStats | None = None, *,
             priority: int = 0, cancel: threading.Event | None = None, first_tokens: int = 0) -> TokenStream:
        """`generate`'s request as its `TokenStream` (the streaming loop reads it `timed()`)."""
        return self.submit(inp, sampler, stats, priority=priority, cancel=cancel, first_tokens=first_tokens)

    def group(self, size: int, timeout_s: float) -> AbstractContextManager[RequestGroup]:
        """A request group (models/batching/group.py): its members join at one step boundary."""
        return self.groups.group(size, timeout_s)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    # --- worker side -------------------------------------------------------------------
    def run_once(self) -> tuple[bool, float | None]:
        """One round: drop cancelled requests, admit, one decode step. Returns
        (whether anything ran, when waiting requests should be looked at again)."""
        self._drop_cancelled()
        with self._cond:
            now = self.clock()
            holding = self.groups.holding(len(self._waiting), now)
            if holding is not None:  # members of a group are still on their way: step the active ones only
                return self._step(), holding
            decision = admit(self.settings, [r.waiting() for r in self._waiting], len(self._active),
                             now, self.delay_ms)
            chosen = {w.key for w in decision.join}
            joining = sorted((r for r in self._waiting if r.key in chosen), key=lambda r: (-r.priority, r.key))
            self._waiting = [r for r in self._waiting if r.key not in chosen]
        for request in joining:
            self._join(request)
        stepped = self._step()
        return bool(joining) or stepped, decision.wake_at

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [r for r in self._waiting if r.cancelled()]
            self._waiting = [r for r in self._waiting if not r.cancelled()]
        for r in gone:
            r.end(self.stats)
        for r in [r for r in self._active.values() if r.cancelled()]:
            self._finish(r)

    def _join(self, request: _Request) -> None:
        req = request.decode
        try:
            t0 = time.perf_counter()
            logp, cache = self.decoder.prefill(*req.prefill_inputs(takes_past=True))  # plain Session.run
            req.stats.prefill_ms += (time.perf_counter() - t0) * 1e3
            if not req.finished:
                self._emit(request, req.accept(logp[0]), time.perf_counter())
            if req.finished:
                request.end(self.stats)
                return
            self.decoder.join(request.key, cache)
        except Exception as exc:
            # Only this request fails: the batch's cache is untouched until join's ops ran.
            request.end(self.stats, _as_engine_error(exc, "LLM prefill failed"))
            return
        self._active[request.key] = request

    def _step(self) -> bool:
        if not self._active:
            return False
        inputs = {key: r.decode.next_input for key, r in self._active.items()}
        t0 = time.perf_counter()
        try:
            logps = self.decoder.step(inputs)
        except Exception as exc:
            # The batch's cache is not trusted after a failed run: every row fails, the worker goes on.
            err = _as_engine_error(exc, f"LLM batched decode step failed ({len(self._active)} requests in the batch)")
            log.error("%s", err)
            self._fail_active(err)
            return True
        ms = (time.perf_counter() - t0) * 1e3
        self.stats.steps += 1
        self.stats.shared_steps += len(logps) > 1
        self.stats.peak_batch = max(self.stats.peak_batch, len(logps))
        requests = [self._active[key] for key in logps]
        for request in requests:
            request.decode.stats.decode_ms += ms
            request.decode.stats.batch_max = max(request.decode.stats.batch_max, len(logps))
        try:
            tokens = accept_rows([r.decode for r in requests], np.stack(list(logps.values())))
        except Exception as exc:  # not one row's sampling (those come back in place): the batch's rows fail
            err = _as_engine_error(exc, "LLM sampling failed")
            for request in requests:
                self._finish(request, err)
            return True
        now = time.perf_counter()
        for request, token in zip(requests, tokens, strict=True):
            if isinstance(token, SynthesisError):
                self._finish(request, _as_engine_error(token, "LLM sampling failed"))
                continue
            self._emit(request, token, now)
            if request.decode.finished:
                self._finish(request)
        return True

    @staticmethod
    def _emit(request: _Request, token: int | None, stamp: float) -> None:
        if token is not None and not request.cancelled():
            request.out.put(token, stamp)

    def _finish(self, request: _Request, error: BaseException | None = None) -> None:
        self._active.pop(request.key, None)
        if request.key in self.decoder.slots:
            self.decoder.leave(request.key)
        request.end(self.stats, error)

    def _fail_active(self, error: SynthesisError) -> None:
        active, self._active = list(self._active.values()), {}
        self.decoder.reset()
        for r in active:
            r.end(self.stats, error)

    def _fail_all(self, error: SynthesisError) -> None:
        with self._cond:
            waiting, self._waiting = self._waiting, []
        for r in waiting:
            r.end(self.stats, error)
        self._fail_active(error)


def start_batcher(bundle: Bundle, backend: str, lm: SpeechTokenLM,
                  settings: BatchSettings | None) -> LlmBatcher | None:
    """The engine's running batcher, or None when batching is off. TensorRT
    engines only run the batch sizes their profiles cover, so a larger
    max_batch_size is refused here rather than failing at the first full batch."""
    if settings is None:
        return None
    if backend == "trt":
        entry = bundle.stages["llm_decode"].raw
        b_max = max((p["B"][2] for p in stage_profiles(entry, "llm_decode") if "B" in p), default=1)
        if settings.max_batch_size > b_max:
            raise BundleError(f"batching max_batch_size {settings.max_batch_size} exceeds the llm_decode engine's "
                              f"largest batch ({b_max}); lower max_batch_size or rebuild the engines with a larger "
                              "B profile")
    return LlmBatcher(lm, settings).start()


def _as_engine_error(exc: Exception, what: str) -> SynthesisError:
    err = SynthesisError(f"{what}: {exc}")
    err.__cause__ = exc
    return err
