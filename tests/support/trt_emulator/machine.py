"""The emulated GPU: device memory as integer addresses backed by host bytes,
page-locked host allocations, streams whose work runs when the host
synchronizes, driver-level contexts per thread, and CUDA graph capture that
records the enqueued work and replays it.

Sources (cited per rule below):
  CUDA driver API, memory: https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html
  CUDA driver API, streams: https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html
  CUDA driver API, graphs: https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html
  CUDA programming guide, CUDA Graphs / stream capture:
    https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#cuda-graphs
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# CUresult codes (cuda.h, CUDA driver API "Data types used by CUDA driver")
SUCCESS = 0
INVALID_VALUE = 1
OUT_OF_MEMORY = 2
NOT_INITIALIZED = 3
INVALID_CONTEXT = 201
INVALID_HANDLE = 400
ILLEGAL_ADDRESS = 700
STREAM_CAPTURE_UNSUPPORTED = 900
STREAM_CAPTURE_INVALIDATED = 901
STREAM_CAPTURE_WRONG_THREAD = 908
UNKNOWN = 999

_BASE = 0x7F00_0000_0000  # where emulated device addresses start (any non-zero value would do)
_ALIGN = 256  # cuMemAlloc: "The allocated memory is suitably aligned for any kind of variable"; 256 in practice


# per thread: how many emulator locks it holds (all of them together), and the frees put off until it holds none
_held = threading.local()


class TrackedRLock:
    """A reentrant lock that counts the emulator locks the calling thread holds. A collected allocation's
    finalizer runs wherever the garbage collector does, also inside a locked section, and the implicit
    synchronization of its free waits on the streams' `running` locks; a thread that drains a stream holds
    that lock while it waits for the machine's: a lock-order deadlock (a CI run of 2026-12-07 hung in
    test_trt_backend.py so). Such a free waits until its thread holds no emulator lock (`defer`)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> TrackedRLock:
        self._lock.acquire()
        _held.depth = getattr(_held, "depth", 0) + 1
        return self

    def __exit__(self, *exc: object) -> None:
        _held.depth -= 1
        self._lock.release()
        if _held.depth == 0:
            while deferred := getattr(_held, "deferred", None):
                fn, args = deferred.pop(0)
                fn(*args)


def defer(fn: Callable[..., object], *args: object) -> bool:
    """True where the calling thread holds an emulator lock: fn(*args) then runs once it holds none."""
    if getattr(_held, "depth", 0) == 0:
        return False
    if not hasattr(_held, "deferred"):
        _held.deferred = []
    _held.deferred.append((fn, args))
    return True


def finalizer(obj: object, fn: Callable[..., object], *args: object) -> weakref.finalize:
    """A weakref finalizer that does not run at interpreter exit (the emulated GPU goes with the process;
    freeing at exit would only run queued work nobody waits for)."""
    f = weakref.finalize(obj, fn, *args)
    f.atexit = False
    return f


class CudaError(Exception):
    """A failed driver call, with its CUresult."""

    def __init__(self, code: int, what: str) -> None:
        super().__init__(f"{what} (CUDA error {code})")
        self.code = code
        self.what = what


@dataclass(frozen=True)
class EmulatedGpu:
    """The GPU the emulator reports (defaults: a Jetson Orin Nano 8 GB, JetPack 6/7)."""

    name: str = "Orin (nvgpu)"
    compute_capability: tuple[int, int] = (8, 7)
    multiprocessors: int = 8
    total_memory_bytes: int = 7_620_000_000
    driver_version: int = 12060


@dataclass
class DeviceAllocation:
    address: int
    nbytes: int
    data: np.ndarray  # uint8
    context: int  # the driver context handle it was allocated in


@dataclass
class Op:
    """One piece of enqueued GPU work; `run` reads and writes memory when the stream executes it."""

    what: str
    run: Callable[[], None]


@dataclass
class StreamState:
    handle: int
    flags: int  # 0: blocking (synchronizes with the legacy stream), 1: CU_STREAM_NON_BLOCKING
    context: int
    pending: list[Op] = field(default_factory=list)
    capture: Capture | None = None
    # held while the stream's work runs: a synchronize returns only after work that another
    # thread's synchronize (a cuMemFree's implicit one) took off the queue has finished too
    running: TrackedRLock = field(default_factory=TrackedRLock)


@dataclass
class Capture:
    thread: int
    mode: int
    ops: list[Op] = field(default_factory=list)
    invalidated: str | None = None  # why, once something illegal happened during the capture


@dataclass
class Graph:
    ops: tuple[Op, ...]


class Machine:
    """One emulated GPU with its memory, streams, contexts and graphs; thread-safe."""

    LEGACY_STREAM = 0

    def __init__(self, gpu: EmulatedGpu) -> None:
        self.gpu = gpu
        self.lock = TrackedRLock()
        self.initialized = False
        self._next = _BASE
        self._allocs: dict[int, DeviceAllocation] = {}
        self._starts: list[int] = []  # sorted keys of _allocs
        self.pinned_bytes = 0  # live page-locked host bytes
        self.pinned_ranges: dict[int, tuple[int, int]] = {}  # id -> (host address, bytes) of live page-locked memory
        self.freed_pinned: dict[int, tuple[int, int]] = {}  # freed page-locked ranges whose arrays still exist
        self.skipped_frees: list[str] = []  # frees pycuda skipped (out-of-thread context): leaks
        self._handles = 0x1000
        self.streams: dict[int, StreamState] = {}
        self.graphs: dict[int, Graph] = {}
        self.execs: dict[int, Graph] = {}
        self.primary_context = self._new_handle()
        self._current = threading.local()  # .stack: the driver-level context stack of this thread
        self.errors: list[str] = []  # failures inside the emulator's C callbacks (tests assert it stays empty)
        # An illegal address inside GPU work is sticky: the context is unusable afterwards (CUDA
        # programming guide, "Error Checking": "sticky error ... the process must be terminated").
        self.fault: CudaError | None = None

    def _new_handle(self) -> int:
        with self.lock:
            self._handles += 0x10
            return self._handles

    # --- contexts (CUDA driver API, Context Management: cuCtxSetCurrent / cuCtxPushCurrent) ---
    def context_stack(self) -> list[int]:
        stack: list[int] | None = getattr(self._current, "stack", None)
        if stack is None:
            stack = []
            self._current.stack = stack
        return stack

    def current_context(self) -> int | None:
        stack = self.context_stack()
        return stack[-1] if stack else None

    def set_current(self, ctx: int) -> None:
        """cuCtxSetCurrent: "If there exists a CUDA context stack on the calling CPU thread, this will
        replace the top of that stack with ctx"; with ctx NULL it pops."""
        stack = self.context_stack()
        if ctx == 0:
            if stack:
                stack.pop()
        elif stack:
            stack[-1] = ctx
        else:
            stack.append(ctx)

    def require_context(self, what: str) -> int:
        """Driver calls need a current context: CUDA_ERROR_INVALID_CONTEXT otherwise."""
        if self.fault is not None:
            raise CudaError(self.fault.code, f"{what}: the context is unusable after: {self.fault.what}")
        if not self.initialized:
            raise CudaError(NOT_INITIALIZED, f"{what}: cuInit has not been called")
        ctx = self.current_context()
        if ctx is None:
            raise CudaError(INVALID_CONTEXT, f"{what}: no CUDA context is current on this thread")
        return ctx

    def unsafe_call(self, what: str) -> None:
        """cuThreadExchangeStreamCaptureMode: during a capture "some actions, such as a call to cudaMalloc,
        may be unsafe"; a thread with its own capture (mode GLOBAL or THREAD_LOCAL), or any thread while
        some capture runs in GLOBAL mode, "is prohibited from potentially unsafe API calls": the call fails
        and the capture is invalidated."""
        me = threading.get_ident()
        with self.lock:
            hits = [s.capture for s in self.streams.values() if s.capture is not None
                    and (s.capture.mode == 0 or (s.capture.mode == 1 and s.capture.thread == me))]
            for cap in hits:
                cap.invalidated = f"{what} during the capture"
        if hits:
            raise CudaError(STREAM_CAPTURE_UNSUPPORTED, f"{what}: not permitted while a stream is capturing")

    def host_kind(self, addr: int, nbytes: int) -> str:
        """'pinned' (inside live page-locked memory), 'freed' (inside page-locked memory already
        freed) or 'pageable'."""
        with self.lock:
            for table, kind in ((self.pinned_ranges, "pinned"), (self.freed_pinned, "freed")):
                for start, n in table.values():
                    if start <= addr and addr + nbytes <= start + n:
                        return kind
        return "pageable"

    # --- device memory (cuMemAlloc / cuMemFree) ---
    def used_bytes(self) -> int:
        with self.lock:
            # a copy: a collected allocation's finalizer may free (same thread, reentrant lock) mid-sum
            return sum(a.nbytes for a in list(self._allocs.values()))

    def alloc(self, nbytes: int, what: str = "cuMemAlloc") -> int:
        ctx = self.require_context(what)
        self.unsafe_call(what)
        if nbytes <= 0:
            # cuMemAlloc: "If bytesize is 0, cuMemAlloc() returns CUDA_ERROR_INVALID_VALUE"
            raise CudaError(INVALID_VALUE, f"{what}: size {nbytes}")
        with self.lock:
            if self.used_bytes() + nbytes > self.gpu.total_memory_bytes:
                raise CudaError(OUT_OF_MEMORY, f"{what}: {nbytes} bytes")
            # GUESS: addresses are never reused, so a stale address always fails (real CUDA may reuse one)
            addr = self._next
            self._next += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN
            self._allocs[addr] = DeviceAllocation(addr, nbytes, np.zeros(nbytes, np.uint8), ctx)
            bisect.insort(self._starts, addr)
            return addr

    def free(self, addr: int) -> None:
        """cuMemFree: "this API may perform implicit synchronization": the emulator always does (work
        still queued that uses the memory runs first)."""
        self.unsafe_call("cuMemFree")
        if self.fault is None:
            try:
                self.synchronize_all()
            except CudaError as exc:  # sticky now; the free itself still happens
                self.errors.append(f"work queued before cuMemFree failed: {exc}")
        with self.lock:
            if addr not in self._allocs:
                raise CudaError(INVALID_VALUE, f"cuMemFree: {addr:#x} is not the start of an allocation")
            del self._allocs[addr]
            self._starts.remove(addr)

    def release(self, addr: int) -> None:
        """cuMemFree from a finalizer (TensorRT freeing what an engine or context owned): a failure is
        recorded, not raised; inside a locked section, once the thread leaves it (TrackedRLock)."""
        if defer(self.release, addr):
            return
        try:
            self.free(addr)
        except CudaError as exc:
            self.errors.append(f"cuMemFree of {addr:#x} failed: {exc}")

    def find(self, addr: int, nbytes: int) -> tuple[DeviceAllocation, int] | None:
        with self.lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            a = self._allocs[self._starts[i]]
            off = addr - a.address
            if off + max(nbytes, 0) > a.nbytes:
                return None
            return a, off

    def span(self, addr: int, nbytes: int, what: str) -> np.ndarray:
        """The bytes [addr, addr + nbytes) of one live allocation (a view); an address outside every
        allocation, or a range running past its end, is an illegal address."""
        hit = self.find(addr, nbytes)
        if hit is None:
            raise CudaError(ILLEGAL_ADDRESS, f"{what}: [{addr:#x}, +{nbytes}) is not inside a live device allocation")
        a, off = hit
        return a.data[off:off + nbytes]

    # --- streams ---
    def create_stream(self, flags: int) -> int:
        ctx = self.require_context("cuStreamCreate")
        handle = self._new_handle()
        with self.lock:
            self.streams[handle] = StreamState(handle, flags, ctx)
        return handle

    def stream(self, handle: int, what: str) -> StreamState | None:
        """None for the legacy default stream (handle 0)."""
        if handle == self.LEGACY_STREAM:
            return None
        with self.lock:
            st = self.streams.get(handle)
        if st is None:
            raise CudaError(INVALID_HANDLE, f"{what}: stream {handle:#x} does not exist")
        return st

    def enqueue(self, handle: int, op: Op) -> None:
        """Work on a stream runs when the host synchronizes (the host must not read results earlier).
        During a capture it is recorded instead (CUDA programming guide, "Stream Capture": work
        launched into a capturing stream is not enqueued for execution)."""
        self.require_context(op.what)
        st = self.stream(handle, op.what)
        if st is None:
            self._legacy(op)
            return
        with self.lock:
            cap = st.capture
            if cap is not None:
                if threading.get_ident() != cap.thread and cap.mode == 1:
                    # GUESS: another thread's work on a stream captured thread-locally invalidates the capture
                    cap.invalidated = f"{op.what} enqueued from another thread"
                cap.ops.append(op)
                return
            st.pending.append(op)

    def _legacy(self, op: Op) -> None:
        """The legacy default stream waits for every blocking stream and they wait for it
        (CUDA runtime API, "Stream synchronization behavior"); work on it while a blocking stream
        is being captured is not allowed (CUDA programming guide, "Cross-stream Dependencies and
        Events" / "Prohibited and Unhandled Operations": "it is invalid to ... synchronize with the
        legacy stream" during capture), so it invalidates that capture."""
        with self.lock:
            blocking = [s for s in self.streams.values() if s.flags == 0]
            for s in blocking:
                if s.capture is not None:
                    s.capture.invalidated = f"{op.what} on the legacy stream during the capture"
        for s in blocking:
            if s.capture is None:
                self.synchronize(s.handle)
        self.run([op])

    def synchronize(self, handle: int) -> None:
        self.require_context("cuStreamSynchronize")
        self._flush(handle)

    def _flush(self, handle: int) -> None:
        st = self.stream(handle, "cuStreamSynchronize")
        if st is None:
            self.synchronize_all()
            return
        self._drain(st, capturing_is_error=True)

    def _drain(self, st: StreamState, capturing_is_error: bool) -> None:
        with st.running:
            with self.lock:
                if st.capture is not None:
                    if not capturing_is_error:
                        return  # began capturing after synchronize_all looked: its queue ran at begin_capture
                    # "Prohibited and Unhandled Operations": synchronizing a capturing stream is an error
                    # and invalidates the capture.
                    st.capture.invalidated = "cuStreamSynchronize on the capturing stream"
                    raise CudaError(STREAM_CAPTURE_UNSUPPORTED, "cuStreamSynchronize on a capturing stream")
                ops, st.pending = st.pending, []
            self.run(ops)

    def run(self, ops: list[Op]) -> None:
        """Execute work; a fault is sticky."""
        for op in ops:
            try:
                op.run()
            except CudaError as exc:
                self.fault = exc
                raise

    def synchronize_all(self) -> None:
        with self.lock:
            # the states, not their handles: another thread may destroy a stream meanwhile (its
            # destroy_stream runs what it still had queued)
            states = [s for s in self.streams.values() if s.capture is None]
        for st in states:
            self._drain(st, capturing_is_error=False)

    def destroy_stream(self, handle: int) -> None:
        with self.lock:
            st = self.streams.pop(handle, None)
        if st is not None and self.fault is None:
            try:
                self._drain(st, capturing_is_error=False)  # cuStreamDestroy: pending work still completes
            except CudaError as exc:  # called from a finalizer: nobody to raise to
                self.errors.append(f"work pending on a destroyed stream failed: {exc}")

    # --- capture and graphs (cuStreamBeginCapture / cuStreamEndCapture / cuGraphInstantiate / cuGraphLaunch) ---
    def begin_capture(self, handle: int, mode: int) -> None:
        st = self.stream(handle, "cuStreamBeginCapture")
        if st is None:
            # cuStreamBeginCapture: "Capture may not be initiated if stream is CU_STREAM_LEGACY"
            raise CudaError(STREAM_CAPTURE_UNSUPPORTED, "cuStreamBeginCapture on the legacy stream")
        with self.lock:
            if st.capture is not None:
                raise CudaError(INVALID_VALUE, "cuStreamBeginCapture: the stream is already capturing")
            if st.pending:
                # GUESS: work still queued before the capture starts runs first (it precedes the capture)
                ops, st.pending = st.pending, []
            else:
                ops = []
        self.run(ops)
        with self.lock:
            st.capture = Capture(threading.get_ident(), mode)

    def end_capture(self, handle: int) -> int:
        st = self.stream(handle, "cuStreamEndCapture")
        if st is None or st.capture is None:
            raise CudaError(INVALID_VALUE, "cuStreamEndCapture: the stream is not capturing")
        with self.lock:
            cap = st.capture
            if cap.thread != threading.get_ident() and cap.mode != 0:
                # cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
                raise CudaError(STREAM_CAPTURE_WRONG_THREAD, "cuStreamEndCapture from another thread")
            st.capture = None
            if cap.invalidated is not None:
                # cuStreamEndCapture: "If the capture was invalidated, then NULL will be returned"
                raise CudaError(STREAM_CAPTURE_INVALIDATED, f"capture invalidated: {cap.invalidated}")
            graph = self._new_handle()
            self.graphs[graph] = Graph(tuple(cap.ops))
            return graph

    def capturing(self, handle: int) -> Capture | None:
        st = self.stream(handle, "cuStreamIsCapturing")
        return None if st is None else st.capture

    def invalidate_capture(self, handle: int, why: str) -> None:
        cap = self.capturing(handle)
        if cap is not None:
            cap.invalidated = why

    def instantiate(self, graph: int) -> int:
        with self.lock:
            g = self.graphs.get(graph)
            if g is None:
                raise CudaError(INVALID_VALUE, f"cuGraphInstantiate: no graph {graph:#x}")
            exec_ = self._new_handle()
            self.execs[exec_] = Graph(g.ops)
            return exec_

    def launch(self, exec_: int, handle: int) -> None:
        """Replays the recorded work with the arguments bound at capture: a device buffer freed
        since then is an illegal address when the replay reaches it."""
        with self.lock:
            g = self.execs.get(exec_)
        if g is None:
            raise CudaError(INVALID_VALUE, f"cuGraphLaunch: no executable graph {exec_:#x}")
        for op in g.ops:
            self.enqueue(handle, op)

    def destroy_graph(self, graph: int) -> None:
        with self.lock:
            if self.graphs.pop(graph, None) is None:
                raise CudaError(INVALID_VALUE, f"cuGraphDestroy: no graph {graph:#x}")

    def destroy_exec(self, exec_: int) -> None:
        with self.lock:
            if self.execs.pop(exec_, None) is None:
                raise CudaError(INVALID_VALUE, f"cuGraphExecDestroy: no executable graph {exec_:#x}")
