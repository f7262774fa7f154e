"""Continuous batching on the fixed-shape (captured-graph) LLM path: one worker
thread runs the iteration-level scheduler (models/batching/iteration.py) over a
`BatchedDecodeStep` (models/batching/batched_step.py). Each round: drop
cancelled streams, admit and prefill (at most max_prefills_between_steps, on
this worker: dynamic sessions), then one step for every running stream, padded
to the next captured batch size, as one piece of work on the engine's GPU graph
thread. Sampling and the length/EOS/fill rules are each stream's own
`RequestDecode` (shared with the unbatched path), and a row's logits do not
depend on the rows beside it, so a seeded stream yields the same tokens alone
and batched. The consumer side (`TokenStream`) is the dynamic batcher's.

`run_once` is one round; tests call it directly to place joins and leaves at
chosen steps."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager

import numpy as np
from cosyedge_models.backends.graph_thread import GraphPriority, GraphThread
from cosyedge_models.backends.ort_graph_decode import GraphDecoder
from cosyedge_models.batching.batched_step import BatchedDecodeStep
from cosyedge_models.batching.fused_step import FusedDecodeStep
from cosyedge_models.batching.group import GroupGate, RequestGroup
from cosyedge_models.batching.iteration import IterationScheduler, IterationSettings
from cosyedge_models.batching.llm_batcher import BatchStats, TokenStream, _as_engine_error, _Request
from cosyedge_models.batching.looped_step import LoopedGraphStep
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.batching.worker import BatchWorker
from cosyedge_models.errors import SynthesisError
from cosyedge_models.synthesis.llm import LlmInput, LlmStats, RequestDecode, SpeechTokenLM, accept_rows
from cosyedge_models.synthesis.sampling import TokenSampler

log = logging.getLogger(__name__)


class GraphBatcher(BatchWorker):
    def __init__(self, lm: SpeechTokenLM, step: BatchedDecodeStep, thread: GraphThread,
                 settings: IterationSettings, clock: Callable[[], float] = time.monotonic,
                 on_stop: Callable[[], None] | None = None,
                 first_chunk_priority: GraphPriority = GraphPriority.NORMAL, prefill_threads: int = 1,
                 batched_prefill: bool = False) -> None:
        super().__init__("llm-graph-batcher", clock)
        if prefill_threads < 1:
            raise ValueError(f"prefill_threads must be >= 1, got {prefill_threads}")
        if settings.rows > step.rows or not set(settings.batch_sizes) <= set(step.batch_sizes):
            raise ValueError(f"the schedule ({settings.rows} rows, sizes {list(settings.batch_sizes)}) does not fit "
                             f"the step ({step.rows} rows, sizes {list(step.batch_sizes)})")
        if first_chunk_priority is GraphPriority.LLM:
            raise ValueError("a step that samples a stream's first chunk runs as NORMAL or FIRST_AUDIO work, not LLM")
        self.lm = lm
        self.step = step
        # a step that samples some stream's first-chunk tokens: NORMAL (behind every first chunk's flow that
        # waits) or FIRST_AUDIO (in arrival order with them); [tts] llm_first_chunk_priority
        self.first_chunk_priority = first_chunk_priority
        self._on_stop = on_stop  # after the worker ended (the engine's batcher gives its slots back)
        self.thread = thread
        self.scheduler = IterationScheduler(settings)  # under _cond: submit() runs on other threads
        self.stats = BatchStats()
        self.delay_ms: float | None = None  # None: the queue delay setting (the engine's load hint sets 0)
        self._keys = itertools.count()
        self._requests: dict[int, _Request] = {}  # admitted or waiting, by key (under _cond)
        self._lengths: dict[int, int] = {}  # running streams' cache lengths (worker-owned)
        self.groups = GroupGate(self.clock, self.kick)  # open groups hold prefills back (models/batching/group.py)
        # a round's prefills at once ([tts] llm_parallel_prefills; each writes its own row): None, one after another
        self._prefill_pool = (ThreadPoolExecutor(prefill_threads, thread_name_prefix="llm-prefill")
                              if prefill_threads > 1 else None)
        # a round's prompts in one prefill run ([tts] llm_batched_prefill), where the step can
        if batched_prefill and not step.batched_prefill:
            log.warning("LLM batched prefill: this step (%s) prefills one prompt at a time; re-export the bundle's "
                        "fused step for one run per round", type(step).__name__)
        self.batched_prefill = batched_prefill and step.batched_prefill

    @property
    def captured_prefill(self) -> bool:
        """Every prompt through the step's captured prefill graphs ([tts] llm_captured_prefill), on the graph thread."""
        return self.step.captured_prefill

    # --- consumer side -----------------------------------------------------------------
    def submit(self, inp: LlmInput, sampler: TokenSampler, stats: LlmStats | None = None, *,
               priority: int = 0, cancel: threading.Event | None = None, first_tokens: int = 0) -> TokenStream:
        return self._submit(self.lm.start(inp, sampler, stats), priority, cancel, first_tokens)

    def _submit(self, decode: RequestDecode, priority: int, cancel: threading.Event | None,
                first_tokens: int = 0) -> TokenStream:
        need = decode.prompt.shape[1] + decode.max_len
        if need > self.step.positions:
            raise SynthesisError(f"a request of {need} positions (prompt + most speech tokens) does not fit the "
                                 f"fixed-size decode's {self.step.positions}")
        request = _Request(next(self._keys), priority, self.clock(), decode, cancel, first_tokens)
        with self._cond:
            if self._stopping:
                raise SynthesisError("the LLM graph batcher is stopped")
            try:
                self.scheduler.arrive(request.key, request.arrived, priority)
            except OverflowError as exc:
                raise SynthesisError(f"the LLM graph batcher's queue is full: {exc}") from exc
            self._requests[request.key] = request
            self._kick()
        if first_tokens > 0:
            # A step held for other streams' first chunks (LLM work) blocks this loop, so the new stream's
            # prefill and first-chunk steps would wait for every hold open (H200, twenty-first run: one of
            # eight streams ~370 ms late in the runs where a step was held): that step goes now as NORMAL work.
            self.thread.release_llm()
        return TokenStream(self, request)

    def generate(self, inp: LlmInput, sampler: TokenSampler, stats: LlmStats | None = None, *,
                 priority: int = 0, cancel: threading.Event | None = None, first_tokens: int = 0) -> Iterator[int]:
        """Like `SpeechTokenLM.generate`, with each step shared with the other running streams; a
        request longer than the step's positions (prompt + most speech tokens: a long text) runs
        alone on the ordinary loop instead of failing. `first_tokens`: the tokens its stream's first
        chunk waits for (until then its steps are first-audio work: _step)."""
        return iter(self.open(inp, sampler, stats, priority=priority, cancel=cancel, first_tokens=first_tokens))

    def open(self, inp: LlmInput, sampler: TokenSampler, stats: LlmStats | None = None, *,
             priority: int = 0, cancel: threading.Event | None = None,
             first_tokens: int = 0) -> TokenStream | Iterator[int]:
        """`generate`'s request: its `TokenStream`, or the ordinary loop's tokens for a long one."""
        decode = self.lm.start(inp, sampler, stats)
        if decode.prompt.shape[1] + decode.max_len > self.step.positions:
            self.stats.unbatched += 1
            log.info("LLM graph batching: a request of %d positions exceeds the step's %d: the ordinary loop",
                     decode.prompt.shape[1] + decode.max_len, self.step.positions)
            return self.lm.generate(inp, sampler, stats)
        return self._submit(decode, priority, cancel, first_tokens)

    def group(self, size: int, timeout_s: float) -> AbstractContextManager[RequestGroup]:
        """A request group: its members start their prefills in one round."""
        return self.groups.group(size, timeout_s)

    @property
    def active(self) -> int:
        with self._cond:
            return len(self.scheduler.running) + self.scheduler.pending_prefills

    @property
    def waiting(self) -> int:
        with self._cond:
            return self.scheduler.waiting

    # --- worker side -------------------------------------------------------------------
    def run_once(self) -> tuple[bool, float | None]:
        """One round: drop cancelled streams, the prefills the scheduler allows, one step."""
        with self._cond:
            for key in [k for k, r in self._requests.items() if r.cancelled()]:
                self._leave(key)
            now = self.clock()
            holding = self.groups.holding(self.scheduler.waiting, now)
            if holding is not None:  # members of a group are still on their way: step the running ones only
                return self._step(), holding
            plan = self.scheduler.prefills(now, self.delay_ms)
        self._prefill_all([(self._requests[p.key], p.row) for p in plan.run])
        stepped = self._step()
        return bool(plan.run) or stepped, plan.wake_at

    def _prefill_all(self, prefills: list[tuple[_Request, int]]) -> None:
        """The round's prefills: with batched_prefill those of one past length in one run each, the
        rest on the prefill threads where there are several (the step waits for all)."""
        if not prefills:
            return
        t0 = time.perf_counter()
        planned = [_Prefill(request, row, *request.decode.prefill_inputs(self.step.takes_past))
                   for request, row in prefills]
        if self.batched_prefill or self.captured_prefill:
            for batch in prefill_batches(planned, 1 if self.captured_prefill else 2):
                self._prefill_batch(batch)
            planned = [p for p in planned if not p.batched]
        if self._prefill_pool is None or len(planned) < 2:
            for p in planned:
                self._prefill(p)
        else:
            for done in [self._prefill_pool.submit(self._prefill, p) for p in planned]:
                done.result()  # _prefill fails only its own stream; anything else fails the round
        self.stats.prefill_s += time.perf_counter() - t0

    def _prefill_batch(self, batch: list[_Prefill]) -> None:
        """Prompts after one past length in one run; each row's last position is its first step's input
        (RequestDecode.next_input starts there), so the row joins this round's step unsampled."""
        t0 = time.perf_counter()
        pasts = None if batch[0].past is None else [p.past for p in batch if p.past is not None]
        run = functools.partial(self.step.prefill_rows, [p.row for p in batch], [p.embeds for p in batch], pasts)
        try:
            if self.captured_prefill:  # first-audio work, as a first chunk's step
                self.thread.call(run, self.first_chunk_priority, "llm_captured_prefill")
            else:
                run()
        except Exception as exc:
            err = _as_engine_error(exc, f"LLM batched prefill failed ({len(batch)} streams)")
            log.error("%s", err)
            with self._cond:  # every row of the run is untrusted: each of its streams fails
                for p in batch:
                    self._leave(p.request.key, err)
            return
        ms = (time.perf_counter() - t0) * 1e3
        if self.captured_prefill:
            self.stats.captured_prefills += len(batch)
        else:
            self.stats.batched_prefills += 1
        with self._cond:
            for p in batch:
                p.request.decode.stats.prefill_ms += ms
                self.scheduler.prefilled(p.request.key, False)
                self._lengths[p.request.key] = p.request.decode.prompt.shape[1] - 1

    def _prefill(self, planned: _Prefill) -> None:
        request, row, req = planned.request, planned.row, planned.request.decode
        try:
            t0 = time.perf_counter()
            logp = self.step.prefill(row, planned.embeds, planned.past)
            req.stats.prefill_ms += (time.perf_counter() - t0) * 1e3
            if not req.finished:
                _emit(request, req.accept(logp[0]), time.perf_counter())
        except Exception as exc:
            # Only this stream fails: a prefill writes its own row only.
            with self._cond:
                self._leave(request.key, _as_engine_error(exc, "LLM prefill failed"))
            return
        with self._cond:
            self.scheduler.prefilled(request.key, req.finished)
            if req.finished:
                self._leave(request.key)
            else:
                self._lengths[request.key] = req.prompt.shape[1]

    def _noted_step(self, rows: Sequence[int], embeds: np.ndarray, lengths: Sequence[int],
                    batch_size: int) -> np.ndarray:
        """The batched step on the graph thread, its rows noted in the trace (GraphThread.note)."""
        self.thread.note(f"rows {len(rows)}, batch {batch_size}")
        return self.step.step(rows, embeds, lengths, batch_size)

    def _step(self) -> bool:
        with self._cond:
            batch = self.scheduler.batch()
            requests = [self._requests[k] for k in batch.keys] if batch is not None else []
        if batch is None:
            return False
        started = time.perf_counter()
        embeds = np.stack([r.decode.next_input for r in requests]).astype(np.float32, copy=False)
        lengths = [self._lengths[k] for k in batch.keys]
        t0 = time.perf_counter()
        try:
            # LLM work (graph_thread.py), which waits while a stream's first chunk is on its way to audio
            # (as the single-stream steps do), unless a row still samples its own first chunk's tokens:
            # then it is first-audio work too. Always held, a step waited for every other stream's first
            # chunk in turn (H200 run 11: 1.0 s of holds at eight streams, the last first hop at 1.65 s);
            # never held, it ran between a first chunk's estimator windows.
            # As NORMAL work it still waits behind every first chunk's flow replay queued (H200, fourteenth run:
            # the last of eight streams' first-chunk tokens at 710 ms); as FIRST_AUDIO it takes its turn among them.
            urgent = any(r.decode.index < r.first_tokens for r in requests)
            logps = self.thread.call(functools.partial(self._noted_step, batch.rows, embeds, lengths, batch.batch_size),
                                     self.first_chunk_priority if urgent else GraphPriority.LLM, "llm_batched_step")
        except Exception as exc:
            # The rows' caches are not trusted after a failed step: every stream in it fails.
            err = _as_engine_error(exc, f"LLM batched step failed ({len(requests)} streams, batch {batch.batch_size})")
            log.error("%s", err)
            with self._cond:
                for key in batch.keys:
                    self._leave(key, err)
            return True
        call_s = time.perf_counter() - t0
        ms = call_s * 1e3
        self.stats.steps += 1
        self.stats.shared_steps += len(requests) > 1
        self.stats.peak_batch = max(self.stats.peak_batch, len(requests))
        for request in requests:
            self._lengths[request.key] += 1
            request.decode.stats.decode_ms += ms
            request.decode.stats.batch_max = max(request.decode.stats.batch_max, len(requests))
        try:
            tokens = accept_rows([r.decode for r in requests], logps)
        except Exception as exc:  # not one row's sampling (those come back in place): the step's rows fail
            err = _as_engine_error(exc, "LLM sampling failed")
            with self._cond:
                for key in batch.keys:
                    self._leave(key, err)
            return True
        now = time.perf_counter()
        for request, token in zip(requests, tokens, strict=True):
            if not isinstance(token, SynthesisError):
                _emit(request, token, now)
        with self._cond:  # once a step, not once a row: the lock is shared with the submitting threads
            for request, token in zip(requests, tokens, strict=True):
                if isinstance(token, SynthesisError):
                    self._leave(request.key, _as_engine_error(token, "LLM sampling failed"))
                    continue
                self.scheduler.stepped(request.key, request.decode.finished)
                if request.decode.finished:
                    self._leave(request.key)
        self.stats.step_call_s += call_s
        self.stats.step_host_s += time.perf_counter() - started - call_s
        return True

    def _leave(self, key: int, error: BaseException | None = None) -> None:
        """(under _cond) the stream leaves the schedule; its consumer gets the end or the error."""
        self.scheduler.remove(key)
        self._lengths.pop(key, None)
        request = self._requests.pop(key, None)
        if request is not None:
            request.end(self.stats, error)

    # --- lifecycle (start/stop: BatchWorker) -------------------------------------------
    def _stopped(self) -> None:
        if self._prefill_pool is not None:
            self._prefill_pool.shutdown(wait=True)
        self._fail_all(SynthesisError("the LLM graph batcher stopped before the request finished"))
        if self._on_stop is not None:
            self._on_stop()

    def _round_failed(self, exc: Exception) -> None:
        self._fail_all(_as_engine_error(exc, "LLM graph batcher round failed"))

    def _fail_all(self, error: SynthesisError) -> None:
        with self._cond:
            for key in list(self._requests):
                self._leave(key, error)


def start_graph_batcher(lm: SpeechTokenLM, batching: BatchSettings | None, prefills_between_steps: int,
                        fused: FusedDecodeStep | None = None, fused_thread: GraphThread | None = None,
                        first_chunk_priority: GraphPriority = GraphPriority.NORMAL,
                        prefill_threads: int = 1, batched_prefill: bool = False) -> GraphBatcher | None:
    """The engine's iteration-level batcher over `fused` (the bundle's fused batched step, run on
    `fused_thread`) where given, else over its fixed-size decode slots (LoopedGraphStep), or
    None: batching off or neither (the dynamic-graph batcher serves then). A max_batch_size
    beyond the step's rows is lowered to them (every stream needs its own cache row)."""
    if batching is None:
        return None
    step: BatchedDecodeStep
    if fused is not None:
        if fused_thread is None:
            raise ValueError("a fused step runs on the graph thread that captured it: give fused_thread")
        step, thread, close = fused, fused_thread, fused.close
    else:
        decoder = lm.fixed_size_decode
        if not isinstance(decoder, GraphDecoder) or decoder.disabled is not None:
            log.info("LLM graph batching: no fused step and no fixed-size decode (%s); the dynamic-graph "
                     "batcher serves the batch", "disabled at load" if isinstance(decoder, GraphDecoder) else
                     "graph_decode off or not in the bundle")
            return None
        looped = LoopedGraphStep(decoder, min(batching.max_batch_size, decoder.slots))
        step, thread, close = looped, decoder.thread, looped.close
    if step.rows < batching.max_batch_size:
        log.warning("LLM graph batching: max_batch_size %d lowered to the step's %d rows (%s)",
                    batching.max_batch_size, step.rows,
                    "the fused graphs' largest batch size" if fused is not None else "graph_decode_slots")
        batching = dataclasses.replace(batching, max_batch_size=step.rows, preferred_batch_sizes=tuple(
            s for s in batching.preferred_batch_sizes if s <= step.rows))
    settings = IterationSettings(batching, step.batch_sizes, step.rows, prefills_between_steps)
    return GraphBatcher(lm, step, thread, settings, on_stop=close, first_chunk_priority=first_chunk_priority,
                        prefill_threads=prefill_threads, batched_prefill=batched_prefill).start()


@dataclasses.dataclass
class _Prefill:
    """A round's prefill: the stream, its row, what it prefills (RequestDecode.prefill_inputs)."""

    request: _Request
    row: int
    embeds: np.ndarray  # [1, T, D]
    past: np.ndarray | None  # its saved prefix's cache, or None
    batched: bool = False  # prefilled in a batched run (prefill_batches)


def prefill_batches(planned: Sequence[_Prefill], smallest: int = 2) -> list[list[_Prefill]]:
    """The prefills that share a run: unfinished streams of at least two prompt positions, grouped by
    their past's length (0: none; a run's pasts are stacked), groups of `smallest` or more; marks them."""
    groups: dict[int, list[_Prefill]] = {}
    for p in planned:
        if not p.request.decode.finished and p.embeds.shape[1] >= 2:
            groups.setdefault(0 if p.past is None else int(p.past.shape[4]), []).append(p)
    batches = [g for g in groups.values() if len(g) >= smallest]
    for g in batches:
        for p in g:
            p.batched = True
    return batches


def _emit(request: _Request, token: int | None, stamp: float) -> None:
    if token is not None and not request.cancelled():
        request.out.put(token, stamp)
