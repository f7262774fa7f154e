"""Batching of one stage graph (the flow estimator, the HiFT source and
decoder) across concurrent requests: `StageBatcher` is a Session that wraps
the real one, so models/synthesis/flow.py and models/synthesis/vocoder.py call `run(feeds)`
unchanged. Calls from the request threads wait in a bounded queue; one
worker thread takes the calls that can merge (models/batching/stage_merge.py) up to
the batch size within the queue delay (the LLM batcher's admission rule,
models/batching/policy.py: Triton's max_batch_size, preferred_batch_sizes,
max_queue_delay_ms, higher priority first), runs them as one graph call and
hands each caller its own rows. A failed run fails exactly the calls in it.

Calls that cannot merge with anything (other graph inputs, more than the
stage's profiles take) run on the caller's thread as without batching, and
so do calls when the queue is full.

How long a call waits: a request calls a stage many times in a row (ten
Euler steps), so the callers served by the last run are about to call
again. A call waits, at most `max_queue_delay_ms`, only while such a caller
is still expected (its call returned less than the delay ago and it has not
called again) and the batch is below its preferred or maximum size; with no
caller expected it runs at once, so a lone request never waits. Without this
the batches stay out of phase: with four requests, one call runs alone while
the other three queue, then those three while the first one queues, and so on.

The priority comes from the calling thread (`call_priority`), which the
engine sets from the request around each stage call, so the Session
signature stays the same."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # the builtin's alias from Python 3.11 on
from dataclasses import dataclass, field

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.batching.policy import BatchSettings, Waiting, admission_order, admit
from cosyedge_models.batching.stage_merge import (
    AxisMerger,
    estimator_merger,
    hift_decoder_merger,
    hift_source_merger,
    profile_fits,
)
from cosyedge_models.batching.worker import IDLE_TICK_S, BatchWorker
from cosyedge_models.bundle.loader import Bundle
from cosyedge_models.errors import SynthesisError
from cosyedge_models.synthesis.flow import CacheDims

log = logging.getLogger(__name__)

_LIMIT_CACHE = 256  # merge keys whose batch limit is remembered (they include lengths: bounded)

_local = threading.local()


@contextlib.contextmanager
def call_priority(priority: int) -> Iterator[None]:
    """Stage calls made by this thread inside the block queue with this priority."""
    before = getattr(_local, "priority", 0)
    _local.priority = priority
    try:
        yield
    finally:
        _local.priority = before


def current_priority() -> int:
    return int(getattr(_local, "priority", 0))


@dataclass
class StageStats:
    runs: int = 0  # graph runs through the worker
    calls: int = 0  # calls they served
    largest: int = 0  # most calls in one run
    alone: int = 0  # calls that ran on their own thread (could not merge, queue full)

    def as_dict(self) -> dict[str, float]:
        return {"runs": self.runs, "calls": self.calls, "largest": self.largest, "alone": self.alone,
                "mean_batch": round(self.calls / self.runs, 3) if self.runs else 0.0}


@dataclass(eq=False)
class _Call:
    key: int
    group: Hashable
    priority: int
    arrived: float
    feeds: Mapping[str, np.ndarray]
    outputs: Sequence[str] | None
    thread: int = field(default_factory=threading.get_ident)
    future: Future[dict[str, np.ndarray]] = field(default_factory=Future)

    def waiting(self) -> Waiting:
        return Waiting(self.key, self.priority, self.arrived)


class StageBatcher(BatchWorker):
    """A Session over `session` whose calls from several threads are merged."""

    def __init__(self, session: Session, merger: AxisMerger, settings: BatchSettings, *,
                 fits: Callable[[Mapping[str, tuple[int, ...]]], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.session = session
        self.merger = merger
        self.settings = settings
        self.fits = fits  # None: any merged shape runs (ONNX Runtime); else the engine's profiles decide
        super().__init__(f"batch-{session.name}", clock)
        self.name, self.input_names, self.output_names = session.name, session.input_names, session.output_names
        self.delay_ms: float | None = None  # None: settings.max_queue_delay_ms (the engine's load hint sets 0)
        self.stats = StageStats()
        self._keys = itertools.count()
        self._waiting: list[_Call] = []
        self._limits: dict[Hashable, BatchSettings] = {}
        self._served: dict[int, float] = {}  # thread -> when its last call returned (worker-written, under _cond)

    # --- lifecycle (start/stop: BatchWorker) -------------------------------------------
    def _stopped(self) -> None:
        with self._cond:
            waiting, self._waiting = self._waiting, []
        for call in waiting:
            call.future.set_exception(SynthesisError(f"{self.name}: the stage batcher stopped before the call ran"))

    # --- Session -----------------------------------------------------------------------
    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        call = self.submit(inputs, outputs)
        if call is None:
            return self.session.run(inputs, outputs)
        while True:
            try:
                return call.future.result(timeout=IDLE_TICK_S)
            except FutureTimeout:
                # Never wait on a worker that is gone (stopped, or never started).
                if not self.worker_alive:
                    self._drop(call)
                    if not call.future.done():
                        raise SynthesisError(f"{self.name}: the stage batcher is not running") from None

    def memory_bytes(self) -> int:
        return self.session.memory_bytes()

    def close(self) -> None:
        """Stops the worker; the wrapped session belongs to whoever loaded it."""
        self.stop()

    # --- queue -------------------------------------------------------------------------
    def submit(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None,
               priority: int | None = None) -> _Call | None:
        """Queue a call; None: it cannot merge or the queue is full, run it alone."""
        group = self.merger.key(inputs, outputs)
        call = None if group is None else _Call(next(self._keys), group,
                                                current_priority() if priority is None else priority,
                                                self.clock(), inputs, outputs)
        with self._cond:
            if self._stopping:
                raise SynthesisError(f"{self.name}: the stage batcher is stopped")
            self._served.pop(threading.get_ident(), None)  # it called again: no longer expected
            if call is None or len(self._waiting) >= self.settings.max_queue_size:
                self.stats.alone += 1
                return None
            self._waiting.append(call)
            self._kick()
        return call

    def _drop(self, call: _Call) -> None:
        with self._cond:
            if call in self._waiting:
                self._waiting.remove(call)

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    # --- worker ------------------------------------------------------------------------
    def run_once(self) -> tuple[bool, float | None]:
        """Run the next batch if one is due. Returns (whether a batch ran, when
        the waiting calls should be looked at again)."""
        with self._cond:
            batch, wake_at = self._pick(self.clock())
            taken = set(map(id, batch))
            self._waiting = [c for c in self._waiting if id(c) not in taken]
        if not batch:
            return False, wake_at
        self._run(batch)
        return True, wake_at

    def _pick(self, now: float) -> tuple[list[_Call], float | None]:
        groups: dict[Hashable, list[_Call]] = {}
        for call in self._waiting:
            groups.setdefault(call.group, []).append(call)
        # The group of the most urgent call first; each group by the admission rule.
        ordered = sorted(groups.values(), key=lambda calls: min((-c.priority, c.key) for c in calls))
        delay_ms = self.settings.max_queue_delay_ms if self.delay_ms is None else self.delay_ms
        # Callers expected back soon (see the module doc); the others are forgotten.
        self._served = {t: at for t, at in self._served.items() if now - at < delay_ms / 1e3}
        expires = min(self._served.values(), default=now) + delay_ms / 1e3
        wake_at: float | None = None
        for calls in ordered:
            decision = admit(self._settings_for(calls), [c.waiting() for c in calls], 0, now,
                             delay_ms if self._served else 0.0)
            if decision.join:
                by_key = {c.key: c for c in calls}
                joining = [by_key[w.key] for w in decision.join]
                # Ragged lengths: only those close to the first's (stage_merge.MIN_FILL).
                return [joining[i] for i in self.merger.select([c.feeds for c in joining])], wake_at
            if decision.wake_at is not None:
                due = min(decision.wake_at, expires)
                wake_at = due if wake_at is None else min(wake_at, due)
        return [], wake_at

    def _settings_for(self, calls: list[_Call]) -> BatchSettings:
        """The settings with max_batch_size cut to what the stage's profiles take for this group."""
        if self.fits is None:
            return self.settings
        group = calls[0].group
        limited = self._limits.get(group)
        if limited is None:
            head = admission_order([c.waiting() for c in calls])[0].key
            feeds = next(c.feeds for c in calls if c.key == head)
            n = self.settings.max_batch_size
            while n > 1 and not self.fits(self.merger.merged_shapes([feeds] * n)):
                n -= 1
            limited = dataclasses.replace(
                self.settings, max_batch_size=n,
                preferred_batch_sizes=tuple(s for s in self.settings.preferred_batch_sizes if s <= n))
            if len(self._limits) >= _LIMIT_CACHE:
                self._limits.clear()
            self._limits[group] = limited
        return limited

    def _run(self, batch: list[_Call]) -> None:
        order = {w.key: i for i, w in enumerate(admission_order([c.waiting() for c in batch]))}
        batch.sort(key=lambda c: order[c.key])
        feeds = [c.feeds for c in batch]
        try:
            if len(batch) == 1:
                parts = [self.session.run(feeds[0], batch[0].outputs)]
            else:
                merged = self.session.run(self.merger.merge(feeds), batch[0].outputs)
                parts = self.merger.split(merged, feeds)
        except Exception as exc:
            what = "run" if len(batch) == 1 else f"batched run of {len(batch)} requests"
            for call in batch:
                err = SynthesisError(f"{self.name}: {what} failed: {exc}")
                err.__cause__ = exc
                call.future.set_exception(err)
            log.error("%s: %s failed: %s", self.name, what, exc)
            return
        self.stats.runs += 1
        self.stats.calls += len(batch)
        self.stats.largest = max(self.stats.largest, len(batch))
        done = self.clock()
        with self._cond:
            for call in batch:
                self._served[call.thread] = done
        for call, part in zip(batch, parts, strict=True):
            call.future.set_result(part)


def start_stage_batching(bundle: Bundle, backend: str, sessions: Mapping[str, Session],
                         settings: BatchSettings | None) -> dict[str, StageBatcher]:
    """Running batchers over the flow estimator and the two HiFT sessions in
    `sessions` (by stage name), to build the flow decoder and the vocoder on;
    none when `settings` is None. On the trt backend merged calls are
    limited to what the engines' optimization profiles take."""
    if settings is None:
        return {}
    from cosyedge_models.backends.profiles import all_input_ranges

    stream_cache = CacheDims.from_manifest(bundle.stages["flow_estimator"].raw).stream_cache
    mergers = {"flow_estimator": estimator_merger(pad_time=stream_cache), "hift_source": hift_source_merger(),
               "hift_decoder": hift_decoder_merger()}
    batchers = {}
    for stage, merger in mergers.items():
        fits = profile_fits(all_input_ranges(bundle.stages[stage].raw, stage)) if backend == "trt" else None
        batchers[stage] = StageBatcher(sessions[stage], merger, settings, fits=fits).start()
    return batchers
