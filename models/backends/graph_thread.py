"""The one thread that runs every CUDA-graph session of an engine.

onnxruntime's CUDA provider keeps the graphs it captures (`enable_cuda_graph`,
one per `gpu_graph_id` run option) in the *calling thread's* context, and
captures them with `cudaStreamCaptureModeGlobal`: a graph captured on one
thread does not exist for another (that thread's first run captures again),
and while any thread captures, a "potentially unsafe" CUDA call from any other
thread (a synchronous copy, an allocation) fails with CUDA error 900
("operation not permitted when stream is capturing") and spoils the capture.
Both were seen on the H200 with concurrent streams (docs/gpu.md).

So every run of a captured session goes through one `GraphThread`: request
threads `call()` a piece of work (copy the inputs in, replay, copy the outputs
out) and wait for its result. The captures themselves are done there at engine
load (the users' warm-up, models/backends/ort_static_flow.py and
ort_graph_decode.py) while no request runs, so no capture ever overlaps
another thread's CUDA work, and afterwards the thread only replays. Work runs
one piece at a time (the replays share the GPU and their bound buffers anyway),
in submission order within its priority: a request's first chunk's flow and
vocoder, inside `first_audio()`, go ahead of the LLM steps and later chunks
(GraphWorkOrder below says how and why). On the CPU provider the same
code runs without capture: that is how it is tested."""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Generic, TypeVar

from cosyedge_models.backends.profiling import GraphTrace, TraceItem
from cosyedge_models.errors import SynthesisError

log = logging.getLogger(__name__)

T = TypeVar("T")
ItemT = TypeVar("ItemT")

# Backends whose engines capture CUDA graphs while they load (the fixed-size LLM step and the
# fixed-shape flow windows, on by default on ort-cuda): no other GPU work of the process may
# run then, so a daemon reload pauses the old engine's requests for it.
CAPTURE_AT_LOAD_BACKENDS = ("ort-cuda",)

# Runs of one session and graph id before onnxruntime's CUDA provider captures
# it: two regular runs (they allocate what the capture may not), the third
# captures and replays (cuda_execution_provider.h, min_num_runs_before_cuda_graph_capture_).
CAPTURE_RUNS = 3


# --- the order of the work -------------------------------------------------------------------
# The order in which the GPU graph thread runs
# its work (GraphWorkOrder): "the first chunk first".
#
# A streaming request's time to first audio is its first chunk's LLM steps, then
# that chunk's flow and vocoder. With the stages overlapped the LLM producer goes
# on decoding the next chunk meanwhile, and on the one graph thread its steps
# alternate with the first chunk's estimator windows: measured on the H200, about
# 35 ms of a 143 ms first-chunk "flow" was the next chunk's LLM steps (docs/gpu.md).
# Ordering by priority alone does not help: the flow's calls come one at a time
# (each waits for the one before), so between two windows the queue holds only
# the LLM step, and it runs.
#
# So the work items are typed (GraphPriority) and a request opens a *first-audio
# hold* around its first chunk's flow and vocoder (GraphThread.first_audio()):
#
# * FIRST_AUDIO work (what a request submits inside its hold) runs ahead of the
#   rest, first in, first out among itself;
# * the rest, NORMAL (flow and vocoder of streams that already speak, warm-up,
#   anything untagged) and LLM (the decode steps, ort_graph_decode.py), runs first
#   in, first out among itself; but while any hold is open, LLM work waits, even
#   on an idle worker, until the holds close. NORMAL work is not held: a stream
#   that already speaks keeps its flow going (holding it would make it stutter).
#
# Two bounds keep the LLM work from starving:
# * a hold blocks for at most `hold_max_s` after it opened (a first chunk that
#   takes longer, e.g. on a slow board, lets the others go on as before);
# * the oldest LLM item is passed over by at most `max_overtakes` items, then
#   the rest runs in its order again (new streams arriving back to back cannot
#   hold it forever).
#
# Once a request's first audio is out it opens no hold again. Pure logic: the
# caller passes the clock in (`now`, seconds), so tests order work without timing.

# Defaults: a full-size first chunk's flow + vocoder is ~150 ms on an H200 (docs/gpu.md) and
# a few times that on a Jetson; past 1.5 s the hold no longer pays for what it delays.
HOLD_MAX_S = 1.5
# an estimator window is ~9 ms on the H200: 64 windows (a first chunk's ten Euler steps of
# ~3-6 windows each) bound an LLM step's wait to about one first chunk
MAX_OVERTAKES = 64


class GraphPriority(enum.IntEnum):
    """A work item's class: FIRST_AUDIO runs first; NORMAL and LLM share one first-in,
    first-out order, except that LLM work waits while a first-audio hold is open."""

    FIRST_AUDIO = 0  # a request's work inside its first-audio hold (first chunk's flow and vocoder)
    NORMAL = 1  # flow and vocoder after the first audio, warm-up, anything untagged
    LLM = 2  # the LLM's decode steps


@dataclass
class OrderStats:
    """What the order did (bench and probe output, logs)."""

    runs: dict[str, int] = field(default_factory=lambda: {p.name.lower(): 0 for p in GraphPriority})
    holds: int = 0  # first-audio holds opened
    deferred: int = 0  # LLM items that waited behind other work or a hold (at least once)
    overtaken: int = 0  # times another item ran before a waiting, older LLM item
    forced: int = 0  # LLM items let go by the overtake bound (ahead of FIRST_AUDIO work or a hold)
    expired: int = 0  # holds that outlived hold_max_s
    released: int = 0  # held LLM items let go as NORMAL work because a new stream waited for them (release_llm)
    held_s: float = 0.0  # time with at least one hold open (summed over closed spans)
    # seconds the worker spent running work, by the label it was submitted with (the profile of
    # where a concurrency level's GPU thread time goes: bench's graph_busy_ms)
    busy_s: dict[str, float] = field(default_factory=dict)
    # seconds the work waited from its submission until the worker took it, by label (behind other
    # work, a hold, or the worker's own wake-up): bench's graph_waited_ms
    waited_s: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {"runs": dict(self.runs), "holds": self.holds, "deferred": self.deferred,
                "overtaken": self.overtaken, "forced": self.forced, "expired": self.expired,
                "released": self.released,
                "held_ms": round(self.held_s * 1e3, 1),
                "busy_ms": {k: round(v * 1e3, 1) for k, v in sorted(self.busy_s.items())},
                "waited_ms": {k: round(v * 1e3, 1) for k, v in sorted(self.waited_s.items())}}


@dataclass
class _Waiting(Generic[ItemT]):
    item: ItemT
    priority: GraphPriority
    overtaken: int = 0
    deferred: bool = False


class GraphWorkOrder(Generic[ItemT]):
    """The queued work and the open holds; `pop` says what runs next. Not thread-safe:
    the graph thread guards it with its lock."""

    def __init__(self, hold_max_s: float = HOLD_MAX_S, max_overtakes: int = MAX_OVERTAKES) -> None:
        if hold_max_s <= 0:
            raise ValueError(f"hold_max_s must be > 0, got {hold_max_s}")
        if max_overtakes < 0:
            raise ValueError(f"max_overtakes must be >= 0, got {max_overtakes}")
        self.hold_max_s = hold_max_s
        self.max_overtakes = max_overtakes
        self._first: deque[_Waiting[ItemT]] = deque()  # FIRST_AUDIO
        self._rest: deque[_Waiting[ItemT]] = deque()  # NORMAL and LLM, in submission order
        self._holds: dict[int, float] = {}  # hold id -> when it opened
        self._next_hold = 0
        self._held_since: float | None = None
        self.stats = OrderStats()

    def __len__(self) -> int:
        return len(self._first) + len(self._rest)

    def pending(self, priority: GraphPriority) -> int:
        queue = self._first if priority is GraphPriority.FIRST_AUDIO else self._rest
        return sum(w.priority is priority for w in queue)

    @property
    def pending_rest(self) -> int:
        """NORMAL and LLM items queued (what a bounded queue bounds)."""
        return len(self._rest)

    @property
    def open_holds(self) -> int:
        return len(self._holds)

    def push(self, item: ItemT, priority: GraphPriority) -> None:
        priority = GraphPriority(priority)
        (self._first if priority is GraphPriority.FIRST_AUDIO else self._rest).append(_Waiting(item, priority))

    def open_hold(self, now: float) -> int:
        """A request starts its first chunk's flow and vocoder; returns the hold's id."""
        hold = self._next_hold
        self._next_hold += 1
        if not self._holds:
            self._held_since = now
        self._holds[hold] = now
        self.stats.holds += 1
        return hold

    def close_hold(self, hold: int, now: float) -> None:
        """Its first audio is out (or the request ended); unknown ids are ignored."""
        opened = self._holds.pop(hold, None)
        if opened is None:
            return
        if now - opened > self.hold_max_s:
            self.stats.expired += 1
        if not self._holds and self._held_since is not None:
            self.stats.held_s += now - self._held_since
            self._held_since = None

    def blocking(self, now: float) -> bool:
        """True while an open hold (younger than hold_max_s) keeps LLM work waiting."""
        return any(now - opened <= self.hold_max_s for opened in self._holds.values())

    def wake_in(self, now: float) -> float | None:
        """Seconds until the youngest blocking hold expires (held LLM work could run then
        without any other event), or None when nothing is held back."""
        if not self._holds or self._oldest_llm() is None:
            return None
        return max(0.0, max(self._holds.values()) + self.hold_max_s - now)

    def release_llm(self) -> int:
        """Every LLM item queued now becomes NORMAL work: it no longer waits for the holds, but runs in
        its turn among the rest (a new stream's first chunk waits for the round that this step blocks:
        GraphBatcher); how many were let go."""
        released = 0
        for waiting in self._rest:
            if waiting.priority is GraphPriority.LLM:
                waiting.priority = GraphPriority.NORMAL
                released += 1
        self.stats.released += released
        return released

    def _oldest_llm(self) -> int | None:
        return next((i for i, w in enumerate(self._rest) if w.priority is GraphPriority.LLM), None)

    def pop(self, now: float, drain: bool = False) -> ItemT | None:
        """The item to run now, or None (nothing queued, or only LLM work behind a hold).
        `drain`: ignore the holds (the worker is closing)."""
        llm = self._oldest_llm()
        waiting = self._rest[llm] if llm is not None else None
        if waiting is not None and waiting.overtaken >= self.max_overtakes:  # the starvation bound
            if self._first or self.blocking(now):
                self.stats.forced += 1
            return self._take(self._rest, 0)  # the rest in its order, up to and with that item
        if self._first:
            return self._take(self._first, 0, waiting)
        if not self._rest:
            return None
        if drain or not self.blocking(now):
            return self._take(self._rest, 0)
        # held: the NORMAL work runs, the LLM work waits
        normal = next((i for i, w in enumerate(self._rest) if w.priority is not GraphPriority.LLM), None)
        if normal is None:
            if waiting is not None:
                self._defer(waiting)
            return None
        return self._take(self._rest, normal, waiting if llm is not None and llm < normal else None)

    def _take(self, queue: deque[_Waiting[ItemT]], index: int, passed: _Waiting[ItemT] | None = None) -> ItemT:
        """Remove and return queue[index]; `passed`: an older LLM item it goes ahead of."""
        if passed is not None:
            passed.overtaken += 1
            self.stats.overtaken += 1
            self._defer(passed)
        waiting = queue[index]
        del queue[index]
        self.stats.runs[waiting.priority.name.lower()] += 1
        return waiting.item

    def _defer(self, waiting: _Waiting[ItemT]) -> None:
        if not waiting.deferred:
            waiting.deferred = True
            self.stats.deferred += 1


class GraphThreadClosed(SynthesisError):
    """Work was submitted to a GraphThread that is closed (or never started)."""


# work, its result, its label, its priority when submitted, submitted at
_Item = tuple[Callable[[], object], Future[object], str, GraphPriority, float]


class GraphThread:
    """A worker thread with a bounded queue of work items; `call` runs one
    there and returns its result or raises its exception in the caller."""

    def __init__(self, name: str = "cosyedge-cuda-graphs", max_pending: int = 64,
                 hold_max_s: float = HOLD_MAX_S, max_overtakes: int = MAX_OVERTAKES) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.name = name
        self.max_pending = max_pending  # NORMAL + LLM items queued at most (FIRST_AUDIO: bounded by the holds)
        # the queued work and the holds (guarded by _lock; its bounds may be set before use)
        self.order: GraphWorkOrder[_Item] = GraphWorkOrder(hold_max_s, max_overtakes)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stopping = False  # closed: the worker runs what is queued, holds ignored, then exits
        self._lock = threading.Lock()  # start / close / submit against close; guards order
        self._changed = threading.Condition(self._lock)  # work queued, a hold closed, room made, stop
        self._local = threading.local()  # per caller thread: depth of its first_audio() blocks here
        self.ident: int | None = None  # the worker's thread id once started
        self.calls = 0  # work items run (tests, logs)
        self.trace: GraphTrace | None = None  # where the worker records each item it runs (bench levels), or None
        self._detail = ""  # what the running item noted of itself (note()); the worker's own

    def start(self) -> GraphThread:
        with self._lock:
            if self._closed:
                raise GraphThreadClosed(f"{self.name}: cannot start a closed GPU graph thread")
            if self._thread is None:
                ready = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(ready,), name=self.name, daemon=True)
                self._thread.start()
                ready.wait()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def note(self, detail: str) -> None:
        """From work running on this thread: what the item did (a replay's rows, Euler step, window), kept with
        it in the trace while one records (bench's graph_trace); elsewhere, or with no trace, nothing."""
        if self.trace is not None and self.on_thread():
            self._detail = detail

    def on_thread(self) -> bool:
        """True when called from the worker itself."""
        return threading.get_ident() == self.ident

    @contextlib.contextmanager
    def first_audio(self) -> Iterator[None]:
        """A request's first chunk (flow and vocoder) on the way to its first audio: what this
        thread submits inside the block (untagged) is FIRST_AUDIO and runs ahead of the rest, and
        LLM work waits while the block is open (bounded: GraphWorkOrder). Nests."""
        with self._lock:
            hold = self.order.open_hold(time.monotonic())
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._changed:
                self.order.close_hold(hold, time.monotonic())
                self._changed.notify_all()

    def release_llm(self) -> int:
        """GraphWorkOrder.release_llm on this thread's queue (the worker re-reads it at once)."""
        with self._changed:
            released = self.order.release_llm()
            if released:
                self._changed.notify_all()
        return released

    def current_priority(self) -> GraphPriority:
        """The priority this thread's untagged submissions get now."""
        return GraphPriority.FIRST_AUDIO if getattr(self._local, "depth", 0) > 0 else GraphPriority.NORMAL

    def pending(self, priority: GraphPriority) -> int:
        """Items of `priority` queued now (tests, logs)."""
        with self._lock:
            return self.order.pending(priority)

    def order_stats(self) -> dict[str, object]:
        """What the ordering did so far (OrderStats), for bench and probe output."""
        with self._lock:
            return self.order.stats.as_dict()

    def submit(self, work: Callable[[], T], priority: GraphPriority | None = None, label: str = "") -> Future[T]:
        """Queue `work` (blocks while the queue is full, except FIRST_AUDIO work); its Future
        carries the result or the exception. `priority`: None takes the calling thread's
        (FIRST_AUDIO inside first_audio(), else NORMAL); LLM steps pass LLM, which a hold does
        not raise (the holder's own LLM work is what must wait). `label`: what kind of work it is,
        for the busy time in order_stats() (empty: the priority's name)."""
        future: Future[T] = Future()
        prio = self.current_priority() if priority is None else GraphPriority(priority)
        with self._changed:
            while True:
                if self._closed or self._thread is None:
                    state = "closed" if self._closed else "not started"
                    raise GraphThreadClosed(f"{self.name}: the GPU graph thread is {state} (the engine was closed); "
                                            "no captured graph can run")
                if prio is GraphPriority.FIRST_AUDIO or self.order.pending_rest < self.max_pending:
                    break
                self._changed.wait()  # full: close() and the worker's pops notify
            # Future[T] is stored as Future[object]: the worker only sets what work() returned
            item = (work, future, label or prio.name.lower(), prio, time.perf_counter())
            self.order.push(item, prio)  # type: ignore[arg-type]
            self._changed.notify_all()
        return future

    def call(self, work: Callable[[], T], priority: GraphPriority | None = None, label: str = "") -> T:
        """Run `work` on the worker and wait for it; on the worker itself it runs inline (its time
        then counts in the label of the work that called it)."""
        if self.on_thread():
            return work()
        return self.submit(work, priority, label).result()

    def _next(self) -> _Item | None:
        """The next item to run, waiting for one; None: closed and nothing left."""
        with self._changed:
            while True:
                item = self.order.pop(time.monotonic(), drain=self._stopping)
                if item is not None:
                    self._changed.notify_all()  # room for a waiting submit
                    return item
                if self._stopping and not len(self.order):
                    return None
                self._changed.wait(self.order.wake_in(time.monotonic()))

    def _run(self, ready: threading.Event) -> None:
        self.ident = threading.get_ident()
        ready.set()
        while (item := self._next()) is not None:
            work, future, label, prio, submitted = item
            if not future.set_running_or_notify_cancel():
                continue
            self._detail = ""
            t0 = time.perf_counter()
            waited = t0 - submitted
            error: BaseException | None = None
            result: object = None
            try:
                result = work()
            except BaseException as exc:  # delivered to the caller, the worker goes on
                error = exc
            t1 = time.perf_counter()
            busy = t1 - t0
            trace = self.trace
            if trace is not None:
                trace.add(TraceItem(self.name, label, prio.name.lower(), submitted, t0, t1, self._detail))
            with self._lock:  # counted before the caller sees its result
                stats = self.order.stats
                stats.busy_s[label] = stats.busy_s.get(label, 0.0) + busy
                stats.waited_s[label] = stats.waited_s.get(label, 0.0) + waited
            self.calls += 1
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

    def close(self, timeout_s: float = 30.0) -> None:
        """Run what is queued, stop the worker and wait for it; later calls raise GraphThreadClosed."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            # after every queued item: they run (their callers wait for them)
            self._stopping = True
            self._changed.notify_all()
        if thread is None:
            return
        if threading.get_ident() != thread.ident:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("%s: still running a replay %.0f s after close()", self.name, timeout_s)

    def __enter__(self) -> GraphThread:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
