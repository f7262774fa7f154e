"""Streaming flow estimator calls as CUDA graphs on TensorRT, over the engines
`cosyedge build engines` builds from the fixed-shape estimator graphs
(edge_build/export/flow_static.py; stages `STATIC_FLOW_PREFIX + W`).

The same plan as the onnxruntime runtime (models/backends/ort_static_flow.py):
one engine per window size W (a bucket: shorter windows right-padded with
mask 0) over a cache of S frames with a validity mask, so every call of one
(slot, window) has the same shapes and addresses. A `TrtSlot` is one Euler
step's cache of one request: a device K/V buffer [S, *row] (zeroed: masked
rows are multiplied by 0, and 0 x NaN is NaN) and the conv history, with one
execution context per window whose tensor addresses are set once and whose
enqueue is captured once into a CUDA graph (models/backends/tensorrt/graph.py).
A `TrtStaticStepCache` borrows a slot for a request's life. Each call is one
piece of work on the engine's GraphThread (window inputs into pinned
buffers, replay: upload, execute, dphi download; then the committed rows of
att_window and conv_cache_new copied into the slot device-to-device), so
the per-window buffers and the contexts' activation memory are shared by all
slots. Slots, contexts and captures are all made at load (`warm_up`).

A request whose window exceeds the largest bucket, or whose cache outgrows S,
moves once, by device copy, to a TrtStepCache over the dynamic engine
(models/backends/tensorrt/flow_cache.py); requests beyond the pool use it from
the start. A saved voice's prefix is seeded by a device copy from the voice's
copy on this GPU. The pure decisions (bucket, mask, rows to copy, slots that
fit) are models/backends/fixed_shapes.py's.

Written against the TensorRT 10 Python API, type-checked against
tensorrt-stubs (tests/models/backends/test_trt_typing.py); never run: no
machine here has TensorRT (the `-m gpu` test in
tests/models/backends/test_trt_static.py is written for one)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.cuda import DeviceBuffer, ThreadCuda
from cosyedge_models.backends.fixed_shapes import (
    AUTO_DEVICE_FRACTION,
    SlotBorrower,
    SlotPool,
    bucket,
    commit_copy,
    commit_index,
    device_total_bytes,
    fixed_shape_names,
    fixed_shapes_wanted,
    flow_request_bytes,
    pad_window,
    prefix_fits,
    slots_that_fit,
    stays_fixed,
    trim_copy,
    valid_mask,
    visible_first,
)
from cosyedge_models.backends.flow_cache import PrefixRows, StepCache, StepCacheSpec
from cosyedge_models.backends.graph_thread import GraphThread
from cosyedge_models.backends.tensorrt.flow_cache import TrtStepCache
from cosyedge_models.backends.tensorrt.graph import (
    CapturedEnqueue,
    CapturedRuntime,
    TensorBuffers,
    execute,
    set_addresses,
    static_shapes,
    user_context,
)
from cosyedge_models.backends.tensorrt.session import TrtSession, thread_cuda
from cosyedge_models.bundle.loader import STATIC_FLOW_PREFIX, Bundle
from cosyedge_models.errors import BundleError, SynthesisError

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

_INPUTS = ("x", "mask", "mu", "t", "spks", "cond", "cache_valid", "commit_index")  # uploaded per call
_OUTPUTS = ("dphi_dt", "att_window", "conv_cache_new")
_SLOT = ("att_cache", "conv_cache")  # the slot's own device buffers
_FLOAT = ("att_cache", "conv_cache", "att_window", "conv_cache_new", "dphi_dt")
WHAT = ("graph_flow on trt needs a bundle exported with 'cosyedge build export --static-flow-windows W,...' "
        "and its engines built with 'cosyedge build engines'")


class _Window:
    """One window size's engine and the I/O buffers every slot binds."""

    def __init__(self, session: TrtSession) -> None:
        self.session = session
        shapes = static_shapes(session)
        missing = [n for n in (*_INPUTS, *_OUTPUTS, *_SLOT) if n not in shapes]
        if missing:
            raise SynthesisError(f"{session.name}: not a fixed-shape estimator engine (lacks {missing})")
        wrong = [n for n in _FLOAT if session.specs[n].dtype != np.float32]
        if wrong:  # the slots are fp32, as the graphs are exported (edge_build/quantize/companions.py)
            raise SynthesisError(f"{session.name}: {wrong} are not fp32 in this engine")
        self.window = int(shapes["x"][2])
        self.att = shapes["att_cache"]
        self.conv = shapes["conv_cache"]
        self.history = int(shapes["commit_index"][0])
        self.io = TensorBuffers(session, (*_INPUTS, *_OUTPUTS))

    def enqueue(self, ctx: trt.IExecutionContext, cuda: ThreadCuda) -> None:
        """What a slot's graph records: the window's inputs up, the engine, dphi down."""
        self.io.upload(cuda, _INPUTS)
        execute(self.session, ctx, cuda)
        self.io.download(cuda, ("dphi_dt",))


class TrtSlot:
    """One Euler step's cache buffers, with a captured run per window size."""

    def __init__(self, index: int, flow: TrtStaticFlow, cuda: ThreadCuda) -> None:
        self.index = index
        self.row_bytes = int(np.prod(flow.row)) * 4
        self.kv = DeviceBuffer(flow.cache_frames * self.row_bytes)
        self.conv = DeviceBuffer(int(np.prod(flow.conv)) * 4)
        cuda.zero(self.kv.ptr, self.kv.nbytes)
        cuda.zero(self.conv.ptr, self.conv.nbytes)
        self.runs: list[CapturedEnqueue] = []
        assert flow.scratch is not None  # made by warm_up before the slots
        for win in flow.io:
            ctx = user_context(win.session, flow.scratch)
            set_addresses(win.session, ctx, {**{n: win.io.ptr(n) for n in (*_INPUTS, *_OUTPUTS)},
                                             "att_cache": self.kv.ptr, "conv_cache": self.conv.ptr})
            self.runs.append(CapturedEnqueue(f"{win.session.name} slot {index}", ctx, cuda,
                                             functools.partial(win.enqueue, ctx, cuda)))

    def ptr(self, frame: int) -> int:
        return self.kv.ptr + frame * self.row_bytes

    def close(self) -> None:
        for run in self.runs:
            run.close()
        self.runs.clear()
        self.kv.close()
        self.conv.close()


class TrtStaticFlow(CapturedRuntime, SlotPool[TrtSlot]):
    """The fixed-shape estimator engines of one engine and their slot pool, run
    on `thread`. `__call__` is a Backend.flow_cache: a TrtStaticStepCache while
    slots last, else TrtStepCache over the dynamic engine. `warm_up()` makes
    every slot and captures every (slot, window) before the engine serves."""

    what = "fixed-shape flow engines"

    def __init__(self, sessions: Sequence[TrtSession], max_slots: int, thread: GraphThread,
                 capture: bool = True) -> None:
        CapturedRuntime.__init__(self, sessions, thread, capture)
        SlotPool.__init__(self, max_slots, thread)
        self.io: list[_Window] = []
        self.windows: list[int] = []
        self.cache_frames = 0
        self.row: tuple[int, ...] = ()
        self.conv: tuple[int, ...] = ()

    def bucket(self, frames: int) -> int | None:
        return bucket(self.windows, frames)

    def _make(self, cuda: ThreadCuda, scratch: DeviceBuffer) -> None:
        self.io = sorted((_Window(s) for s in self._sessions), key=lambda w: w.window)
        self.windows = [w.window for w in self.io]
        sizes = {w.att[0] for w in self.io}
        if len(sizes) > 1 or len({(w.att[1:], w.conv) for w in self.io}) > 1:
            raise SynthesisError(f"fixed-shape estimator engines with different cache shapes {sorted(sizes)}")
        self.cache_frames, self.row, self.conv = self.io[0].att[0], self.io[0].att[1:], self.io[0].conv
        for win in self.io:  # defined inputs for the warm-up runs: zero masks, no valid cache rows
            win.io.zero_host()
        while self.slot_count < self.max_slots:
            slot = TrtSlot(self.slot_count, self, cuda)
            self.register(slot)  # freed by close() even if its warm-up fails (which disables the pool)
            for run in slot.runs:
                self.prepare(run)

    def acquire(self, spec: StepCacheSpec) -> TrtSlot | None:
        if self.disabled is not None or spec.dtype != np.float32 or spec.row != self.row or spec.conv != self.conv:
            return None  # the fixed-shape engines take fp32 caches of this model's shapes
        return self.take_slot()

    def __call__(self, session: Session, spec: StepCacheSpec) -> StepCache:
        if not isinstance(session, TrtSession):
            raise SynthesisError(f"fixed-shape flow engines need a TensorRT estimator session, got {session!r}")
        slot = self.acquire(spec)
        if slot is None:
            return TrtStepCache(session, spec)
        return TrtStaticStepCache(self, slot, session, spec)

    def _dispose(self) -> None:
        for slot in self.drop_slots():
            slot.close()
        for win in self.io:
            win.io.close()


@dataclass(frozen=True)
class _Call:
    window: int  # index into TrtStaticFlow.io
    feeds: Mapping[str, np.ndarray]
    valid: np.ndarray
    commit: int
    at: int  # the slot frame the committed rows go to


class DevicePrefix:
    """A voice's saved rows on one GPU (PrefixRows.lease), freed by close() when the
    voice cache retires the voice and no request copies from it."""

    def __init__(self, host: np.ndarray, cuda: ThreadCuda) -> None:
        data = np.ascontiguousarray(host, dtype=np.float32)
        self.buffer = DeviceBuffer(data.nbytes)
        cuda.htod(self.buffer.ptr, data)
        cuda.synchronize()

    def close(self) -> None:
        self.buffer.close()


def copy_device_prefix(cuda: ThreadCuda, device_id: int, dst_ptr: int, rows: PrefixRows) -> None:
    """The voice's saved rows (fp32) copied to `dst_ptr` from their copy on this GPU, made
    on first use; done (synchronized) before the lease ends."""
    if not rows.host.size:
        return
    with rows.lease(("trt", device_id), functools.partial(DevicePrefix, cuda=cuda), DevicePrefix.close) as src:
        cuda.dtod(dst_ptr, src.buffer.ptr, rows.host.size * 4)
        cuda.synchronize()


class TrtStaticStepCache(SlotBorrower[TrtSlot, TrtStepCache]):
    """StepCache on a TrtSlot; moves to a TrtStepCache over the dynamic engine
    when a call does not fit the fixed shapes."""

    def __init__(self, flow: TrtStaticFlow, slot: TrtSlot, dynamic: TrtSession, spec: StepCacheSpec) -> None:
        super().__init__(slot)
        self.spec = spec
        self._flow = flow
        self._dynamic = dynamic

    def _move(self) -> TrtStepCache:
        """To the dynamic engine: the visible rows and the conv history by device copy."""
        slot = self._slot
        assert slot is not None
        moved = TrtStepCache(self._dynamic, self.spec)
        first = visible_first(self._length, self.spec.visible)
        moved.adopt(slot.ptr(first), self._length - first, slot.conv.ptr)
        self._give_back()
        self._moved = moved
        self._flow.note_move()
        log.debug("flow cache: %d frames moved to the dynamic engine", self._length - first)
        return moved

    def preload(self, rows: PrefixRows, conv: np.ndarray) -> None:
        """A saved voice's prefix into the slot: the rows by device copy from the voice's copy on
        this GPU, the conv history uploaded; a prefix leaving no room for a window goes dynamic."""
        if self._length or self._moved is not None:
            raise RuntimeError("preload() on a cache that holds frames")
        slot, flow = self._slot, self._flow
        if slot is None or not prefix_fits(rows.frames, flow.windows, flow.cache_frames):
            self._move().preload(rows, conv)
            return
        cuda = thread_cuda(flow.device_id)
        copy_device_prefix(cuda, flow.device_id, slot.ptr(0), rows)
        cuda.htod(slot.conv.ptr, np.ascontiguousarray(conv, dtype=np.float32))
        cuda.synchronize()
        self._length = rows.frames

    def run(self, feeds: Mapping[str, np.ndarray], commit: int) -> np.ndarray:
        if self._closed:
            raise RuntimeError("flow cache used after close()")
        flow = self._flow
        w = flow.bucket(int(feeds["x"].shape[2]))
        if self._moved is None and not stays_fixed(w, self._length, commit, flow.cache_frames,
                                                   flow.disabled is not None):
            self._move()
        if self._moved is not None:
            return self._moved.run(feeds, commit)
        slot = self._slot
        assert slot is not None and w is not None
        valid = valid_mask(flow.cache_frames, visible_first(self._length, self.spec.visible), self._length)
        call = _Call(w, feeds, valid, commit, self._length)
        out = flow.replay(functools.partial(_replay, flow, slot, call), "fixed-shape flow engines")
        if out is None:
            return self._move().run(feeds, commit)  # nothing was committed: the same call there
        self._length += commit
        return out

    def trim(self) -> None:
        if self._moved is not None:
            self._moved.trim()
            return
        slot = self._slot
        copy = trim_copy(self._length, self.spec.visible, self._flow.cache_frames) if slot is not None else None
        if slot is None or copy is None:
            return
        cuda = thread_cuda(self._flow.device_id)
        cuda.dtod(slot.ptr(copy.dst), slot.ptr(copy.src), copy.nbytes(slot.row_bytes))
        cuda.synchronize()
        self._length = copy.frames

    def nbytes(self) -> int:
        if self._moved is not None:
            return self._moved.nbytes()
        return 0 if self._slot is None else self._slot.kv.nbytes + self._slot.conv.nbytes

    def _give_back(self) -> None:
        """The slot back to the pool with a zero conv history for its next borrower (its K/V
        rows are masked by cache_valid), whether this cache closes or moves."""
        if self._slot is not None:
            cuda = thread_cuda(self._flow.device_id)
            cuda.zero(self._slot.conv.ptr, self._slot.conv.nbytes)
            cuda.synchronize()
            self._flow.release(self._slot)
            self._slot = None

    def close(self) -> None:
        self._give_back()
        if self._moved is not None:
            self._moved.close()
            self._moved = None
        self._length = 0
        self._closed = True


def _replay(flow: TrtStaticFlow, slot: TrtSlot, call: _Call) -> np.ndarray:
    """One call on the graph thread: inputs in, replay, committed rows into the slot, dphi out."""
    win = flow.io[call.window]
    io, feeds = win.io, call.feeds
    frames = int(feeds["x"].shape[2])
    for name in ("x", "mask", "mu", "cond"):
        io.host(name)[...] = pad_window(feeds[name], win.window)
    io.host("t")[...] = feeds["t"]
    io.host("spks")[...] = feeds["spks"]
    io.host("cache_valid")[...] = call.valid
    io.host("commit_index")[...] = commit_index(call.commit, win.history)
    cuda = thread_cuda(flow.device_id)
    slot.runs[call.window].run()
    copy = commit_copy(call.at, call.commit)
    if copy is not None:
        cuda.dtod(slot.ptr(copy.dst), io.ptr("att_window") + copy.src * slot.row_bytes, copy.nbytes(slot.row_bytes))
        cuda.dtod(slot.conv.ptr, io.ptr("conv_cache_new"), slot.conv.nbytes)
    cuda.synchronize()
    out = np.array(io.host("dphi_dt")[:, :, :frames])
    flow.replays += 1
    return out


def load_trt_static_flow(bundle: Bundle, backend_name: str, load: Callable[[str], Session], setting: bool | None,
                         slots: int, graph_thread: Callable[[], GraphThread]) -> TrtStaticFlow | None:
    """The engine's fixed-shape estimator engines with `slots` requests' worth of caches (one
    per Euler step each), made and captured now on the graph thread, or None. `setting` as
    ort_static_flow.load_static_flow's: None auto (on for trt when the bundle has the engines,
    with as many of `slots` as fit in AUTO_DEVICE_FRACTION of the GPU's memory), True, False."""
    names = fixed_shape_names(bundle.stages, STATIC_FLOW_PREFIX)
    if not (fixed_shapes_wanted(names, setting, backend_name, bundle.root, WHAT) and backend_name == "trt"):
        return None
    sessions = [load(n) for n in names]
    trt_sessions = [s for s in sessions if isinstance(s, TrtSession)]
    if len(trt_sessions) != len(sessions):
        return None  # a wrapped backend (tests): the dynamic engine
    shapes = [static_shapes(s) for s in trt_sessions]
    if len({s["att_cache"][0] for s in shapes}) > 1:
        raise BundleError(f"{bundle.root}: fixed-shape estimator engines with different cache sizes; re-export")
    if setting is None:
        per_request = flow_request_bytes(shapes[0]["att_cache"], shapes[0]["conv_cache"], bundle.flow.n_timesteps)
        total = device_total_bytes(trt_sessions[0].device_id)
        slots = slots_that_fit(slots, per_request, total)
        if slots == 0:
            log.info("flow estimator: fixed-shape engines off (auto): one request's caches take %.1f GB, more than "
                     "%.0f%% of the GPU's %.1f GB; set graph_flow on to force, or export a smaller "
                     "--static-flow-cache", per_request / 1e9, AUTO_DEVICE_FRACTION * 100, total / 1e9)
            return None
    flow = TrtStaticFlow(trt_sessions, slots * bundle.flow.n_timesteps, graph_thread())
    flow.warm_up()
    log.info("flow estimator: fixed-shape TensorRT engines for windows %s over %d cached frames, %d request "
             "slots%s%s", flow.windows, flow.cache_frames, slots, ", CUDA graphs" if flow.capture else "",
             f" (disabled: {flow.disabled})" if flow.disabled else "")
    return flow
