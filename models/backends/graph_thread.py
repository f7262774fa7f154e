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
another thread's CUDA work, and afterwards the thread only replays. Work is
run in submission order, one piece at a time (the replays share the GPU and
their bound buffers anyway). On the CPU provider the same code runs without
capture: that is how it is tested."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import TypeVar

from cosyedge_models.errors import SynthesisError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Backends whose engines capture CUDA graphs while they load (the fixed-size LLM step and the
# fixed-shape flow windows, on by default on ort-cuda): no other GPU work of the process may
# run then, so a daemon reload pauses the old engine's requests for it.
CAPTURE_AT_LOAD_BACKENDS = ("ort-cuda",)

# Runs of one session and graph id before onnxruntime's CUDA provider captures
# it: two regular runs (they allocate what the capture may not), the third
# captures and replays (cuda_execution_provider.h, min_num_runs_before_cuda_graph_capture_).
CAPTURE_RUNS = 3


class GraphThreadClosed(SynthesisError):
    """Work was submitted to a GraphThread that is closed (or never started)."""


class _Stop:
    pass


_STOP = _Stop()


class GraphThread:
    """A worker thread with a bounded queue of work items; `call` runs one
    there and returns its result or raises its exception in the caller."""

    def __init__(self, name: str = "cosyedge-cuda-graphs", max_pending: int = 64) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.name = name
        self._queue: queue.Queue[tuple[Callable[[], object], Future[object]] | _Stop] = queue.Queue(max_pending)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()  # start / close / submit against close
        self.ident: int | None = None  # the worker's thread id once started
        self.calls = 0  # work items run (tests, logs)

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

    def on_thread(self) -> bool:
        """True when called from the worker itself."""
        return threading.get_ident() == self.ident

    def submit(self, work: Callable[[], T]) -> Future[T]:
        """Queue `work` (blocks while the queue is full); its Future carries the result or the exception."""
        future: Future[T] = Future()
        while True:
            with self._lock:
                if self._closed or self._thread is None:
                    state = "closed" if self._closed else "not started"
                    raise GraphThreadClosed(f"{self.name}: the GPU graph thread is {state} (the engine was closed); "
                                            "no captured graph can run")
                try:
                    # Future[T] is stored as Future[object]: the worker only sets what work() returned
                    self._queue.put((work, future), timeout=0.05)  # type: ignore[arg-type]
                    return future
                except queue.Full:
                    pass
            # full: wait outside the lock so that close() can get in

    def call(self, work: Callable[[], T]) -> T:
        """Run `work` on the worker and wait for it; on the worker itself it runs inline."""
        if self.on_thread():
            return work()
        return self.submit(work).result()

    def _run(self, ready: threading.Event) -> None:
        self.ident = threading.get_ident()
        ready.set()
        while True:
            item = self._queue.get()
            if isinstance(item, _Stop):
                return
            work, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = work()
            except BaseException as exc:  # delivered to the caller, the worker goes on
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                self.calls += 1

    def close(self, timeout_s: float = 30.0) -> None:
        """Run what is queued, stop the worker and wait for it; later calls raise GraphThreadClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        self._queue.put(_STOP)  # after every queued item: they run (their callers wait for them)
        if threading.get_ident() != thread.ident:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("%s: still running a replay %.0f s after close()", self.name, timeout_s)

    def __enter__(self) -> GraphThread:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
