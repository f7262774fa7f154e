"""The one place that calls CUDA: contexts, streams, device and pinned
buffers, copies (pycuda), and CUDA graph capture (the driver API through
ctypes, because pycuda has no graph API).

Contexts: every worker thread makes the device's *primary* context current
and owns its own stream. The primary context is the one the CUDA runtime, and
so TensorRT, uses; engines deserialized once are then valid on every worker
thread, while each thread enqueues on its own stream. (A separate
`make_context()` per thread would isolate the threads but would need every
engine, with its weights, deserialized once per thread: too much memory on an
8 GB Jetson.)

How a thread holds it: at the driver level (cuCtxSetCurrent, through
ctypes), which needs no undoing, and NOT on pycuda's own per-thread context
stack: pycuda aborts the whole process (its context_stack destructor calls
abort()) when a thread ends with a context still pushed there; that is what
killed the interpreter when three threads copied at once and the first one
finished (test_cuda_layer.py::test_each_thread_has_its_own_stream on the
H200). pycuda needs its stack only to create and free its objects (device
and pinned allocations, streams), so those happen inside `pycuda_scope`,
which pushes the primary context and pops it again; frees then work from any
thread. The copies and TensorRT's calls need only the driver-level binding.

pycuda ships no type information, so the calls used here are described by the
Protocols below and the module is cast to them: mypy checks our use of them.
pycuda is not a PyPI dependency of cosyedge (it builds only against a real
libcuda); on the board: pip install pycuda==2025.1.2 (README, Jetson)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
from cosyedge_models.backends.gpu_probe import CudaLibrary, cuda_library, cuda_library_generation, probe_gpu
from cosyedge_models.errors import MissingExtraError, SynthesisError

log = logging.getLogger(__name__)


class _Stream(Protocol):
    handle: int

    def synchronize(self) -> None: ...


class _Allocation(Protocol):
    def __int__(self) -> int: ...

    def free(self) -> None: ...


class _HostAllocation(Protocol):
    """The `base` of an array from pagelocked_empty (pycuda's PagelockedHostAllocation)."""

    def free(self) -> None: ...


class _Context(Protocol):
    def push(self) -> None: ...

    def detach(self) -> None: ...


class _ContextClass(Protocol):
    def pop(self) -> None: ...


class _Device(Protocol):
    def name(self) -> str: ...

    def compute_capability(self) -> tuple[int, int]: ...

    def total_memory(self) -> int: ...

    def retain_primary_context(self) -> _Context: ...


class _Memcpy2D(Protocol):
    src_x_in_bytes: int
    src_pitch: int
    dst_x_in_bytes: int
    dst_pitch: int
    width_in_bytes: int
    height: int

    def set_src_device(self, ptr: int) -> None: ...

    def set_dst_device(self, ptr: int) -> None: ...

    def __call__(self, stream: _Stream) -> None: ...


class _Driver(Protocol):
    """The subset of pycuda.driver that cosyedge uses."""

    Context: _ContextClass

    def init(self, flags: int = 0) -> None: ...

    def Device(self, ordinal: int) -> _Device: ...

    def Stream(self, flags: int = 0) -> _Stream: ...

    def Memcpy2D(self) -> _Memcpy2D: ...

    def mem_alloc(self, nbytes: int) -> _Allocation: ...

    def mem_get_info(self) -> tuple[int, int]: ...

    def pagelocked_empty(self, shape: Sequence[int], dtype: Any) -> np.ndarray: ...

    def memcpy_htod_async(self, dest: int, src: np.ndarray, stream: _Stream | None = None) -> None: ...

    def memcpy_dtoh_async(self, dest: np.ndarray, src: int, stream: _Stream | None = None) -> None: ...

    def memcpy_dtod_async(self, dest: int, src: int, size: int, stream: _Stream | None = None) -> None: ...

    def memset_d8_async(self, dest: int, data: int, count: int, stream: _Stream | None = None) -> None: ...


STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING (pycuda.driver.stream_flags.NON_BLOCKING)

_driver_lock = threading.Lock()
_driver: _Driver | None = None
_primary: dict[int, _Context] = {}
_generation = -1  # gpu_probe.cuda_library_generation() the caches below were built with


def generation() -> int:
    """The CUDA library generation now (gpu_probe.use_cuda_library): objects made under another one
    (a thread's ThreadCuda) belong to a driver that is gone."""
    return cuda_library_generation()


def _drop_stale() -> None:
    """Forget the driver, contexts and library when the CUDA library was replaced (under _driver_lock)."""
    global _driver, _libcuda, _generation
    if _generation != cuda_library_generation():
        _driver, _libcuda = None, None
        _primary.clear()
        _primary_handles.clear()
        _generation = cuda_library_generation()


def driver() -> _Driver:
    """pycuda.driver, initialised once (only after the GPU probe said yes)."""
    global _driver
    with _driver_lock:
        _drop_stale()
        if _driver is None:
            gpu = probe_gpu()
            if not gpu.available:
                raise SynthesisError(f"no usable GPU: {gpu.reason}")
            try:
                mod = importlib.import_module("pycuda.driver")
            except ImportError as exc:
                raise MissingExtraError("pycuda", "jetson", "the TensorRT backend") from exc
            drv = cast(_Driver, mod)
            drv.init()
            _driver = drv
        return _driver


def _primary_context(device_id: int) -> _Context:
    drv = driver()
    with _driver_lock:
        ctx = _primary.get(device_id)
        if ctx is None:
            ctx = drv.Device(device_id).retain_primary_context()
            _primary[device_id] = ctx
        return ctx


_libcuda: CudaLibrary | None = None
_primary_handles: dict[int, int] = {}  # device -> CUcontext of its primary context (retained for the process)
_bound = threading.local()  # .device: the device whose primary context this thread has current


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise SynthesisError(f"{what} failed with CUDA error {rc}")


def _lib() -> CudaLibrary:
    global _libcuda
    driver()  # cuInit, after the GPU probe
    with _driver_lock:
        if _libcuda is None:
            _libcuda = cuda_library()
            if _libcuda is None:
                raise SynthesisError("libcuda.so.1 cannot be loaded")
        return _libcuda


def bind_thread(device_id: int) -> None:
    """Make the device's primary context current on the calling thread at the
    driver level: what the async copies, graph capture and TensorRT's runtime
    calls use. Nothing to undo when the thread ends."""
    lib = _lib()
    with _driver_lock:
        handle = _primary_handles.get(device_id)
        if handle is None:
            dev = ctypes.c_int(0)
            _check(lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(device_id)), "cuDeviceGet")
            ctx = ctypes.c_void_p(0)
            _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            handle = int(ctx.value or 0)
            _primary_handles[device_id] = handle
    _check(lib.cuCtxSetCurrent(ctypes.c_void_p(handle)), "cuCtxSetCurrent")
    _bound.device = device_id


def bound_device() -> int:
    """The device bound on this thread (bind_thread), else 0."""
    device: int = getattr(_bound, "device", 0)
    return device


@contextlib.contextmanager
def pycuda_scope(device_id: int | None = None) -> Iterator[None]:
    """The primary context on pycuda's own stack for the block only (pycuda
    allocates and frees its objects in the context on top of it; a thread
    must never end with it non-empty). Default: the thread's bound device."""
    ctx = _primary_context(bound_device() if device_id is None else device_id)
    ctx.push()
    try:
        yield
    finally:
        driver().Context.pop()


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    compute_capability: str
    total_memory_bytes: int


def device_info(device_id: int) -> DeviceInfo:
    dev = driver().Device(device_id)
    major, minor = dev.compute_capability()
    return DeviceInfo(dev.name(), f"{major}.{minor}", int(dev.total_memory()))


class DeviceBuffer:
    """Device memory of a fixed size, freed by close()."""

    def __init__(self, nbytes: int, device_id: int | None = None) -> None:
        self.nbytes = max(int(nbytes), 1)
        self.device_id = bound_device() if device_id is None else device_id
        with pycuda_scope(self.device_id):
            self._alloc: _Allocation | None = driver().mem_alloc(self.nbytes)
        self.ptr = int(self._alloc)

    def close(self) -> None:
        """Free the memory (any thread: pycuda frees in the context on its stack)."""
        if self._alloc is not None:
            with pycuda_scope(self.device_id):
                self._alloc.free()
            self._alloc = None


class DriverBuffer:
    """Zeroed device memory of exactly `nbytes` from the CUDA driver (cuMemAlloc), freed by close():
    the large fixed caches that onnxruntime binds by pointer (the batched estimator lanes, the
    fixed-shape flow slots). onnxruntime's Python allocator grows its arena in powers of two: on an
    H100 a 1.5 GB OrtValue took 2 GB and a 3 GB one 4 GB (docs/benchmarks/capture-memory-h100-2026-12-05.json),
    so the lanes' 42 GB asked for 64 GB and the captures after them ran out of memory. The driver
    through ctypes, without pycuda (ort-cuda has none); the device's primary context, the one
    onnxruntime uses, is retained for the buffer's life and made current for each call."""

    def __init__(self, nbytes: int, device_id: int = 0) -> None:
        if nbytes <= 0:
            raise ValueError(f"a device buffer needs at least one byte, got {nbytes}")
        lib = cuda_library()
        if lib is None or not probe_gpu().available:
            raise SynthesisError("no usable GPU for a device buffer: " + probe_gpu().reason)
        self._lib, self.nbytes, self.device_id = lib, int(nbytes), device_id
        _check(lib.cuInit(ctypes.c_uint(0)), "cuInit")
        dev, ctx = ctypes.c_int(0), ctypes.c_void_p(0)
        _check(lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(device_id)), "cuDeviceGet")
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self._dev, self._ctx = dev, ctx
        ptr = ctypes.c_uint64(0)
        try:
            self._current()
            _check(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(self.nbytes)), f"cuMemAlloc of {nbytes} bytes")
        except SynthesisError:
            lib.cuDevicePrimaryCtxRelease_v2(dev)
            raise
        self.ptr: int = int(ptr.value)
        self._freed = False
        try:
            # zeroed: free rows are masked, and a weight of 0 times a NaN left in memory would be NaN;
            # synchronized: onnxruntime's streams do not wait for the legacy stream's memset
            _check(lib.cuMemsetD8_v2(ctypes.c_uint64(self.ptr), ctypes.c_ubyte(0), ctypes.c_size_t(self.nbytes)),
                   "cuMemsetD8")
            _check(lib.cuCtxSynchronize(), "cuCtxSynchronize")
        except SynthesisError:
            self.close()
            raise

    def _current(self) -> None:
        _check(self._lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        """A host copy of bytes [offset, offset + nbytes) (synchronous: tests, diagnostics)."""
        if self._freed or offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise SynthesisError(f"read of [{offset}, +{nbytes}) outside the device buffer's {self.nbytes} bytes")
        host = np.empty(nbytes, np.uint8)
        if nbytes:
            self._current()
            _check(self._lib.cuMemcpyDtoH_v2(ctypes.c_void_p(host.ctypes.data), ctypes.c_uint64(self.ptr + offset),
                                             ctypes.c_size_t(nbytes)), "cuMemcpyDtoH")
        return host

    def close(self) -> None:
        """Free the memory (after the work queued on it: cuMemFree synchronizes); twice is a no-op."""
        if self._freed:
            return
        self._freed = True
        self._current()
        _check(self._lib.cuMemFree_v2(ctypes.c_uint64(self.ptr)), "cuMemFree")
        self._lib.cuDevicePrimaryCtxRelease_v2(self._dev)

    def __enter__(self) -> DriverBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pinned_empty(nbytes: int) -> np.ndarray:
    """Page-locked host bytes (async copies need them; on Jetson the same DRAM),
    allocated in the bound device's primary context. Free them with free_pinned:
    pycuda frees a page-locked allocation only with its context current (from
    a garbage-collected array on another thread it warns and leaks it)."""
    with pycuda_scope():
        return driver().pagelocked_empty((max(int(nbytes), 1),), np.uint8)


def free_pinned(host: np.ndarray, device_id: int | None = None) -> None:
    """Free an array from pinned_empty now, in its context (pushed for the call, so from
    any thread); the array must not be used afterwards. An already freed one is skipped."""
    owner = host.base if host.base is not None else host
    while isinstance(owner, np.ndarray) and owner.base is not None:  # a view of a view
        owner = owner.base
    if isinstance(owner, np.ndarray):
        raise SynthesisError("free_pinned: not an array from pinned_empty")
    with pycuda_scope(device_id):
        cast(_HostAllocation, owner).free()


class ThreadCuda:
    """What one worker thread owns: the primary context made current on it and
    its own stream. Create it on the thread that uses it."""

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self.generation = generation()
        bind_thread(device_id)
        self.thread = threading.get_ident()
        with pycuda_scope(device_id):
            # non-blocking: no implicit sync with the legacy default stream, which other
            # threads' work may use and which would invalidate a capture running here
            self.stream = driver().Stream(STREAM_NON_BLOCKING)
        self.graphs = GraphApi()

    @property
    def handle(self) -> int:
        return int(self.stream.handle)

    def htod(self, dst_ptr: int, src: np.ndarray) -> None:
        driver().memcpy_htod_async(dst_ptr, src, self.stream)

    def dtoh(self, dst: np.ndarray, src_ptr: int) -> None:
        driver().memcpy_dtoh_async(dst, src_ptr, self.stream)

    def dtod(self, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        driver().memcpy_dtod_async(dst_ptr, src_ptr, nbytes, self.stream)

    def zero(self, dst_ptr: int, nbytes: int) -> None:
        driver().memset_d8_async(dst_ptr, 0, nbytes, self.stream)

    def copy_2d(self, dst_ptr: int, dst_pitch: int, src_ptr: int, src_pitch: int, width: int, height: int) -> None:
        """`height` rows of `width` bytes between device buffers (cuMemcpy2DAsync)."""
        if width == 0 or height == 0:
            return
        if width == src_pitch == dst_pitch:
            self.dtod(dst_ptr, src_ptr, width * height)
            return
        cp = driver().Memcpy2D()
        cp.set_src_device(src_ptr)
        cp.set_dst_device(dst_ptr)
        cp.src_pitch, cp.dst_pitch = src_pitch, dst_pitch
        cp.width_in_bytes, cp.height = width, height
        cp(self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        """Wait for the stream's work (nothing to pop: pycuda's stack holds no
        context between calls, the driver-level binding needs no undoing)."""
        self.synchronize()


class CudaGraph:
    """An instantiated CUDA graph, launched on a stream."""

    def __init__(self, api: GraphApi, graph: int, exec_: int) -> None:
        self._api, self._graph, self._exec = api, graph, exec_

    def launch(self, stream_handle: int) -> None:
        self._api.check(self._api.lib.cuGraphLaunch(ctypes.c_void_p(self._exec), ctypes.c_void_p(stream_handle)),
                        "cuGraphLaunch")

    def close(self) -> None:
        if self._exec:
            self._api.lib.cuGraphExecDestroy(ctypes.c_void_p(self._exec))
            self._api.lib.cuGraphDestroy(ctypes.c_void_p(self._graph))
            self._exec = self._graph = 0


class GraphApi:
    """cuStreamBeginCapture / cuStreamEndCapture / cuGraphInstantiateWithFlags /
    cuGraphLaunch from libcuda (CUDA >= 11.4, so JetPack 6 and 7)."""

    _MODE_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: other threads may keep working

    def __init__(self) -> None:
        self.lib = _lib()
        self._begin = getattr(self.lib, "cuStreamBeginCapture_v2", None) or self.lib.cuStreamBeginCapture

    @staticmethod
    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise SynthesisError(f"{what} failed with CUDA error {rc}")

    def begin(self, stream_handle: int) -> None:
        self.check(self._begin(ctypes.c_void_p(stream_handle), ctypes.c_int(self._MODE_THREAD_LOCAL)),
                   "cuStreamBeginCapture")

    def end(self, stream_handle: int) -> CudaGraph:
        graph = ctypes.c_void_p(0)
        self.check(self.lib.cuStreamEndCapture(ctypes.c_void_p(stream_handle), ctypes.byref(graph)),
                   "cuStreamEndCapture")
        exec_ = ctypes.c_void_p(0)
        rc = self.lib.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, ctypes.c_ulonglong(0))
        if rc != 0:
            self.lib.cuGraphDestroy(graph)
            self.check(rc, "cuGraphInstantiateWithFlags")
        return CudaGraph(self, int(graph.value or 0), int(exec_.value or 0))

    def abort(self, stream_handle: int) -> None:
        """End a failed capture and drop what it recorded."""
        graph = ctypes.c_void_p(0)
        if self.lib.cuStreamEndCapture(ctypes.c_void_p(stream_handle), ctypes.byref(graph)) == 0 and graph.value:
            self.lib.cuGraphDestroy(graph)
