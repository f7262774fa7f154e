"""TensorRT sessions: `.plan` engines executed with execute_async_v3 (the
backend that loads them is tensorrt/backend.py).

Written against the TensorRT 10 Python API and type-checked with
tensorrt-stubs 10.13 (JetPack 7.0); every call used here also exists in
TensorRT 10.3 (JetPack 6.2), the oldest release we support: name-based I/O
(num_io_tensors / get_tensor_name / get_tensor_mode / get_tensor_dtype /
get_tensor_profile_shape), set_input_shape / set_tensor_address /
execute_async_v3 / set_optimization_profile_async, device_memory_size_v2
(10.1+).

Threads: an engine (ICudaEngine: weights) is deserialized once per stage and
shared; each worker thread that runs a session gets, on first use, its own
CUDA stream (cosyedge_models.backends.cuda.ThreadCuda), its own IExecutionContext and
its own I/O buffers: device buffers and pinned host buffers allocated once
per optimization profile at that profile's max shapes and reused for every
call. Sessions can therefore be shared between threads like ONNX Runtime
sessions, while the GPU work of each thread stays on its own stream.

Nothing here runs without a GPU and real TensorRT: `TrtBackend()` checks both
(cosyedge_models.backends.gpu_probe) before importing tensorrt."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
from cosyedge_models.backends.cuda import DeviceBuffer, ThreadCuda, free_pinned, pinned_empty
from cosyedge_models.backends.cuda import generation as cuda_generation
from cosyedge_models.backends.gpu_probe import import_tensorrt
from cosyedge_models.backends.profiles import ProfileShapes, ShapeRange, choose_profile
from cosyedge_models.errors import SynthesisError

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

_logger_lock = threading.Lock()
_trt_logger: trt.ILogger | None = None


def trt_logger() -> trt.ILogger:
    """TensorRT wants one logger per process, shared by builders and runtimes."""
    global _trt_logger
    import_tensorrt()
    import tensorrt as trt

    with _logger_lock:
        if _trt_logger is None:
            _trt_logger = trt.Logger(trt.Logger.WARNING)
        return _trt_logger


@dataclass(frozen=True)
class TensorSpec:
    name: str
    is_input: bool
    dtype: np.dtype
    host_side: bool  # a shape-inference input: TensorRT reads it from host memory


@dataclass
class IoBuffers:
    """Device memory and a page-locked host twin of the same size (one tensor, sized
    for a profile's max). close() frees both explicitly, in the device's context."""

    device: DeviceBuffer
    host: np.ndarray  # uint8, page-locked

    @classmethod
    def allocate(cls, nbytes: int) -> IoBuffers:
        return cls(DeviceBuffer(nbytes), pinned_empty(nbytes))

    def view(self, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
        """The host twin's first bytes as `dtype` [shape] (a view)."""
        n = _volume(shape) * dtype.itemsize
        if n > self.host.nbytes:
            raise SynthesisError(f"{tuple(shape)} {dtype} exceeds its page-locked buffer of {self.host.nbytes} bytes")
        return self.host[:n].view(dtype).reshape(tuple(shape))

    def nbytes(self) -> int:
        return self.device.nbytes + self.host.nbytes

    def close(self) -> None:
        self.device.close()
        if self.host.size:
            free_pinned(self.host, self.device.device_id)
            self.host = self.host[:0]  # nothing left to touch


class Closable(Protocol):
    def nbytes(self) -> int: ...

    def close(self) -> None: ...


@dataclass
class ThreadState:
    cuda: ThreadCuda
    engine: trt.ICudaEngine
    name: str
    profile: int = -1
    # made on first use (its activation memory is allocated then): the decode loop
    # runs its own contexts on one shared scratch and never needs this one
    _context: trt.IExecutionContext | None = None
    buffers: dict[int, dict[str, IoBuffers]] = field(default_factory=dict)
    # Per-thread resources other users of this context own (the decode loop's KV cache).
    extras: dict[str, Closable] = field(default_factory=dict)

    @property
    def context(self) -> trt.IExecutionContext:
        if self._context is None:
            context = self.engine.create_execution_context()
            if context is None:
                raise SynthesisError(f"{self.name}: TensorRT could not create an execution context "
                                     "(out of GPU memory?)")
            self._context = context
        return self._context

    @property
    def has_context(self) -> bool:
        return self._context is not None

    def nbytes(self) -> int:
        own = sum(b.nbytes() for bufs in self.buffers.values() for b in bufs.values())
        return own + sum(x.nbytes() for x in self.extras.values())

    def close(self) -> None:
        self._context = None  # TensorRT frees a context with its last reference
        for bufs in self.buffers.values():
            for b in bufs.values():
                b.close()
        self.buffers.clear()
        for x in self.extras.values():
            x.close()
        self.extras.clear()


def dims(d: trt.Dims) -> tuple[int, ...]:
    """A TensorRT Dims as a tuple (-1 marks a dimension not yet known)."""
    return tuple(int(d[i]) for i in range(len(d)))


def _volume(shape: Sequence[int]) -> int:
    return int(math.prod(shape)) if shape else 1


class TrtSession:
    """One stage engine. `run` may be called from any thread; each thread uses
    its own execution context, stream and buffers."""

    def __init__(self, name: str, path: Path, engine: trt.ICudaEngine, device_id: int) -> None:
        import tensorrt as trt

        self.name = name
        self.path = path
        self.engine = engine
        self.device_id = device_id
        specs = []
        for i in range(engine.num_io_tensors):
            tname = engine.get_tensor_name(i)
            specs.append(TensorSpec(
                name=tname,
                is_input=engine.get_tensor_mode(tname) == trt.TensorIOMode.INPUT,
                dtype=np.dtype(trt.nptype(engine.get_tensor_dtype(tname))),
                host_side=bool(engine.is_shape_inference_io(tname)),
            ))
        self.specs = {s.name: s for s in specs}
        self.input_names = tuple(s.name for s in specs if s.is_input)
        self.output_names = tuple(s.name for s in specs if not s.is_input)
        self.profiles: list[ProfileShapes] = []
        for p in range(engine.num_optimization_profiles):
            prof: ProfileShapes = {}
            for n in self.input_names:
                if self.specs[n].host_side:
                    continue
                lo, opt, hi = engine.get_tensor_profile_shape(n, p)
                prof[n] = ShapeRange(dims(lo), dims(opt), dims(hi))
            self.profiles.append(prof)
        # inputs a caller may leave out, made from the ones it gives (llm_prefill on
        # llm_decode's engine: an empty past_kv, tensorrt/backend.py)
        self.defaults: dict[str, Callable[[Mapping[str, np.ndarray]], np.ndarray]] = {}
        self._local = threading.local()
        self._states: list[ThreadState] = []
        self._lock = threading.Lock()
        self._closed = False

    # --- per-thread state -------------------------------------------------------------
    def state(self) -> ThreadState:
        st: ThreadState | None = getattr(self._local, "state", None)
        if st is None:
            if self._closed:
                raise SynthesisError(f"{self.name}: session is closed")
            st = ThreadState(thread_cuda(self.device_id), self.engine, self.name)
            self._local.state = st
            with self._lock:
                self._states.append(st)
        return st

    def select_profile(self, st: ThreadState, profile: int) -> None:
        if st.profile != profile:
            if not st.context.set_optimization_profile_async(profile, st.cuda.handle):
                raise SynthesisError(f"{self.name}: cannot select optimization profile {profile}")
            st.profile = profile

    def activate(self, st: ThreadState, profile: int) -> dict[str, IoBuffers]:
        """Switch the thread's context to `profile` and return its buffers
        (allocated on first use at the profile's max shapes)."""
        self.select_profile(st, profile)
        bufs = st.buffers.get(profile)
        if bufs is None:
            bufs = self._allocate(st, profile)
            st.buffers[profile] = bufs
        return bufs

    def _allocate(self, st: ThreadState, profile: int) -> dict[str, IoBuffers]:
        ctx = st.context
        sizes: dict[str, int] = {}
        for n in self.input_names:
            spec = self.specs[n]
            if spec.host_side:
                # (profile_index, name): the binding's positional order in 10.3 and 10.13
                values = self.engine.get_tensor_profile_values(profile, n)
                sizes[n] = len(values[2]) * spec.dtype.itemsize
                continue
            hi_shape = self.profiles[profile][n].max
            ctx.set_input_shape(n, hi_shape)
            sizes[n] = _volume(hi_shape) * spec.dtype.itemsize
        for n in self.output_names:
            shape = dims(ctx.get_tensor_shape(n))
            if any(d < 0 for d in shape):
                raise SynthesisError(f"{self.name}: output {n} has a data-dependent shape {shape}; not supported")
            sizes[n] = _volume(shape) * self.specs[n].dtype.itemsize
        return {n: IoBuffers.allocate(size) for n, size in sizes.items()}

    # --- Session ------------------------------------------------------------------------
    def host_view(self, buf: IoBuffers, name: str, shape: Sequence[int]) -> np.ndarray:
        dtype = self.specs[name].dtype
        nbytes = _volume(shape) * dtype.itemsize
        if nbytes > buf.host.nbytes:
            raise SynthesisError(f"{self.name}: {name} of shape {tuple(shape)} exceeds the buffer sized for the "
                              "profile's max shape")
        return buf.host[:nbytes].view(dtype).reshape(tuple(shape))

    def bind_input(self, st: ThreadState, bufs: dict[str, IoBuffers], name: str, value: np.ndarray) -> None:
        spec = self.specs[name]
        arr = np.asarray(value)
        if arr.dtype.kind != spec.dtype.kind and not (arr.dtype.kind in "iu" and spec.dtype.kind in "iu"):
            raise SynthesisError(f"{self.name}: input {name} must be {spec.dtype}, got {arr.dtype}")
        buf = bufs[name]
        host = self.host_view(buf, name, arr.shape)
        host[...] = arr
        if not st.context.set_input_shape(name, arr.shape):
            raise SynthesisError(f"{self.name}: TensorRT rejected shape {arr.shape} for input {name}")
        if spec.host_side:
            st.context.set_tensor_address(name, int(host.ctypes.data))
        else:
            if host.size:  # an empty tensor (no cached frames yet) has nothing to copy
                st.cuda.htod(buf.device.ptr, host)
            st.context.set_tensor_address(name, buf.device.ptr)

    def bind_outputs(self, st: ThreadState, bufs: dict[str, IoBuffers]) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for n in self.output_names:
            shape = dims(st.context.get_tensor_shape(n))
            if any(d < 0 for d in shape):
                raise SynthesisError(f"{self.name}: shape of output {n} unresolved ({shape}); are all inputs set?")
            if _volume(shape) * self.specs[n].dtype.itemsize > bufs[n].device.nbytes:
                raise SynthesisError(f"{self.name}: output {n} {shape} exceeds its buffer")
            st.context.set_tensor_address(n, bufs[n].device.ptr)
            shapes[n] = shape
        return shapes

    def execute(self, st: ThreadState) -> None:
        if not st.context.execute_async_v3(st.cuda.handle):
            raise SynthesisError(f"{self.name}: TensorRT execution failed (see the TensorRT log above)")

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        if self.defaults:
            inputs = {**{n: fill(inputs) for n, fill in self.defaults.items() if n not in inputs}, **inputs}
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise SynthesisError(f"{self.name}: missing inputs {missing} (expects {list(self.input_names)})")
        names = list(outputs) if outputs is not None else list(self.output_names)
        unknown = [n for n in names if n not in self.output_names]
        if unknown:
            raise SynthesisError(f"{self.name}: unknown outputs {unknown} (has {list(self.output_names)})")
        st = self.state()
        shapes = {n: tuple(np.shape(inputs[n])) for n in self.input_names if not self.specs[n].host_side}
        bufs = self.activate(st, choose_profile(self.profiles, shapes, self.name))
        for n in self.input_names:
            self.bind_input(st, bufs, n, inputs[n])
        out_shapes = self.bind_outputs(st, bufs)
        self.execute(st)
        views = {}
        for n in names:
            views[n] = self.host_view(bufs[n], n, out_shapes[n])
            st.cuda.dtoh(views[n], bufs[n].device.ptr)
        st.cuda.synchronize()
        # Copies: the pinned buffers are reused by the next call.
        return {n: v.copy() for n, v in views.items()}

    def memory_bytes(self) -> int:
        """Plan size (weights) + activation memory per thread context + I/O buffers."""
        total = self.path.stat().st_size
        with self._lock:
            states = list(self._states)
        total += sum(st.has_context for st in states) * int(self.engine.device_memory_size_v2)
        return total + sum(st.nbytes() for st in states)

    def close(self) -> None:
        """Free every thread's buffers and contexts (the caller must have
        stopped using the session on all threads)."""
        self._closed = True
        with self._lock:
            states, self._states = self._states, []
        for st in states:
            st.cuda.synchronize()
            st.close()
        self._local = threading.local()


_thread_cuda = threading.local()


def thread_cuda(device_id: int) -> ThreadCuda:
    """The calling thread's CUDA context + stream for `device_id` (one per
    thread, shared by all sessions the thread runs so that their work is
    ordered on one stream)."""
    per_thread: dict[int, ThreadCuda] | None = getattr(_thread_cuda, "devices", None)
    if per_thread is None:
        per_thread = {}
        _thread_cuda.devices = per_thread
    tc = per_thread.get(device_id)
    if tc is None or tc.generation != cuda_generation():  # the CUDA library was replaced (emulator in tests)
        tc = ThreadCuda(device_id)
        per_thread[device_id] = tc
    return tc
