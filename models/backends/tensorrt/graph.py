"""Fixed-shape TensorRT engines (the bundle's fixed-shape stages, built by
`cosyedge build engines` with every input static) replayed as CUDA graphs:
the pieces models/backends/tensorrt/static_flow.py and tensorrt/static_vocoder.py share.

* `static_shapes`: every I/O tensor's shape, read from the engine (all
  static, so no optimization profile and no set_input_shape at run time).
* `TensorBuffers`: a device buffer and its pinned host twin per tensor, at
  the static shape, allocated once.
* `user_context`: an execution context on activation memory the caller
  gives (ExecutionContextAllocationStrategy.USER_MANAGED + set_device_memory,
  TensorRT 10.1+): every context of one runner shares one scratch buffer,
  which is safe because a runner runs one call at a time on one stream (its
  GraphThread), and which keeps N slots x W windows contexts from taking N x W
  activation arenas.
* `CapturedEnqueue`: one context whose tensor addresses are set once; its
  enqueue (uploads from the pinned buffers, execute_async_v3, downloads) runs
  once plainly (TensorRT does its deferred per-context setup on the first
  enqueue) and is then recorded into a CUDA graph by stream capture
  (models/backends/cuda.py's GraphApi, as tensorrt/decode.py captures its step);
  each call replays it. A capture that fails (an engine TensorRT cannot
  capture) leaves the plain enqueue, with a logged warning.

Written against the TensorRT 10 Python API as typed by tensorrt-stubs 10.13
(tests/models/backends/test_trt_typing.py); never run: no machine here has
TensorRT."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
from cosyedge_models.backends.cuda import CudaGraph, DeviceBuffer, ThreadCuda
from cosyedge_models.backends.graph_thread import GraphThread, GraphThreadClosed
from cosyedge_models.backends.tensorrt.session import IoBuffers, TrtSession, dims, thread_cuda
from cosyedge_models.errors import SynthesisError

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)


def static_shapes(session: TrtSession) -> dict[str, tuple[int, ...]]:
    """Every I/O tensor's shape; a SynthesisError if one is not static."""
    shapes = {}
    for name in (*session.input_names, *session.output_names):
        shape = dims(session.engine.get_tensor_shape(name))
        if any(d < 0 for d in shape):
            raise SynthesisError(f"{session.name}: {name} has a dynamic shape {shape}; a fixed-shape stage's engine "
                                 "must be static: rebuild it with 'cosyedge build engines'")
        shapes[name] = shape
    return shapes


class TensorBuffers:
    """Device memory and a pinned host twin for each named tensor of a static engine."""

    def __init__(self, session: TrtSession, names: Iterable[str]) -> None:
        shapes = static_shapes(session)
        self.shapes = {n: shapes[n] for n in names}
        self.dtypes = {n: session.specs[n].dtype for n in self.shapes}
        self.buffers: dict[str, IoBuffers] = {}
        for name, shape in self.shapes.items():
            nbytes = int(np.prod(shape, dtype=np.int64)) * self.dtypes[name].itemsize
            self.buffers[name] = IoBuffers.allocate(nbytes)

    def host(self, name: str) -> np.ndarray:
        """The pinned host buffer of `name` as an array of its dtype and shape (a view)."""
        buf, dtype = self.buffers[name], self.dtypes[name]
        nbytes = int(np.prod(self.shapes[name], dtype=np.int64)) * dtype.itemsize
        return buf.host[:nbytes].view(dtype).reshape(self.shapes[name])

    def ptr(self, name: str) -> int:
        return self.buffers[name].device.ptr

    def upload(self, cuda: ThreadCuda, names: Iterable[str]) -> None:
        for name in names:
            cuda.htod(self.ptr(name), self.host(name))

    def download(self, cuda: ThreadCuda, names: Iterable[str]) -> None:
        for name in names:
            cuda.dtoh(self.host(name), self.ptr(name))

    def zero_host(self) -> None:
        for buf in self.buffers.values():
            buf.host[...] = 0

    def nbytes(self) -> int:
        return sum(b.nbytes() for b in self.buffers.values())

    def close(self) -> None:
        for buf in self.buffers.values():
            buf.close()
        self.buffers.clear()


def scratch_bytes(sessions: Iterable[TrtSession]) -> int:
    """Activation memory one context of any of these engines needs (their shared scratch)."""
    return max((int(s.engine.device_memory_size_v2) for s in sessions), default=0)


def user_context(session: TrtSession, scratch: DeviceBuffer) -> trt.IExecutionContext:
    """A context of `session`'s engine on the caller's activation memory `scratch`."""
    import tensorrt as trt

    ctx = session.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
    if ctx is None:
        raise SynthesisError(f"{session.name}: TensorRT could not create an execution context (out of GPU memory?)")
    needed = int(session.engine.device_memory_size_v2)
    if needed > scratch.nbytes:
        raise SynthesisError(f"{session.name}: needs {needed} bytes of activation memory, the scratch has "
                             f"{scratch.nbytes}")
    ctx.set_device_memory(scratch.ptr, scratch.nbytes)
    return ctx


def set_addresses(session: TrtSession, ctx: trt.IExecutionContext, addresses: dict[str, int]) -> None:
    """Bind every I/O tensor of the engine, once: a captured graph replays these addresses."""
    missing = [n for n in (*session.input_names, *session.output_names) if n not in addresses]
    if missing:
        raise SynthesisError(f"{session.name}: no buffer for {missing}")
    for name, ptr in addresses.items():
        if not ctx.set_tensor_address(name, ptr):
            raise SynthesisError(f"{session.name}: TensorRT rejected the address of {name}")


def execute(session: TrtSession, ctx: trt.IExecutionContext, cuda: ThreadCuda) -> None:
    if not ctx.execute_async_v3(cuda.handle):
        raise SynthesisError(f"{session.name}: TensorRT execution failed (see the TensorRT log above)")


class CapturedEnqueue:
    """One context's enqueue, captured once into a CUDA graph and replayed, or
    (capture off or refused) enqueued plainly on every call."""

    def __init__(self, what: str, ctx: trt.IExecutionContext, cuda: ThreadCuda, enqueue: Callable[[], None]) -> None:
        self.what = what
        self.context = ctx  # kept alive while its graph may replay
        self._cuda = cuda
        self._enqueue = enqueue
        self.graph: CudaGraph | None = None

    def prepare(self, capture: bool) -> bool:
        """The warm-up enqueue, then (with `capture`) the recording; True when captured."""
        cuda = self._cuda
        self._enqueue()
        cuda.synchronize()
        if not capture:
            return False
        try:
            cuda.graphs.begin(cuda.handle)
            try:
                self._enqueue()
            except Exception:
                cuda.graphs.abort(cuda.handle)
                raise
            self.graph = cuda.graphs.end(cuda.handle)
        except Exception as exc:  # a refused capture must not fail the engine: the plain enqueue still works
            log.warning("%s: CUDA graph capture failed (%s); enqueueing without a graph", self.what, exc)
            return False
        return True

    def run(self) -> None:
        if self.graph is not None:
            self.graph.launch(self._cuda.handle)
        else:
            self._enqueue()

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
            self.graph = None


class CapturedRuntime:
    """The skeleton of the fixed-shape TensorRT runtimes (tensorrt/static_flow.py,
    static_encoder.py, static_vocoder.py): their engines' sessions, the GraphThread that
    makes, captures and replays everything, and one activation scratch for all their
    contexts. `warm_up()` makes the scratch and then the runtime's own buffers, contexts
    and captures (`_make`) on that thread; a SynthesisError there disables the runtime
    (the dynamic engines serve), logged. `close()` frees them (`_dispose`) and the scratch
    on that thread too, where their page-locked memory's context is current."""

    what = "fixed-shape engines"

    def __init__(self, sessions: Sequence[TrtSession], thread: GraphThread, capture: bool) -> None:
        if not sessions:
            raise ValueError(f"no {self.what}")
        self.thread = thread
        self.capture = capture  # False once a capture was refused: the rest enqueue plainly
        self.device_id = sessions[0].device_id
        self._sessions = list(sessions)
        self.scratch: DeviceBuffer | None = None  # the contexts' shared activation memory, made at warm_up
        self.disabled: str | None = None  # set when the load failed: the dynamic engines serve

    def warm_up(self) -> None:
        self.thread.call(self._warm_up)

    def _warm_up(self) -> None:
        try:
            cuda = thread_cuda(self.device_id)
            self.scratch = DeviceBuffer(scratch_bytes(self._sessions))
            self._make(cuda, self.scratch)
            cuda.synchronize()
        except SynthesisError as exc:
            self.disabled = str(exc)[:500]
            log.warning("%s disabled at load, the dynamic engines take over: %s", self.what, exc)

    def _make(self, cuda: ThreadCuda, scratch: DeviceBuffer) -> None:
        """The runtime's buffers, contexts and captures (on the graph thread)."""
        raise NotImplementedError

    def prepare(self, run: CapturedEnqueue) -> None:
        """`run`'s warm-up and capture; a refused capture turns capturing off for the rest."""
        if not run.prepare(self.capture):
            self.capture = False

    def close(self) -> None:
        """Free everything (on the graph thread, where it was made)."""
        try:
            self.thread.call(self._close)
        except GraphThreadClosed:
            self._close()

    def _close(self) -> None:
        self._dispose()
        if self.scratch is not None:
            self.scratch.close()
            self.scratch = None

    def _dispose(self) -> None:
        """Free what _make made."""
        raise NotImplementedError
