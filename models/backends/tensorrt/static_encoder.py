"""Streaming flow encoder calls as CUDA graphs on TensorRT, over the engines
`cosyedge build engines` builds from the fixed-shape encoder graphs
(edge_build/export/flow_encoder_static.py; stages `STATIC_ENCODER_PREFIX + T`).

The same plan as the onnxruntime runtime (models/backends/ort_static_encoder.py),
built as tensorrt/static_flow.py is: one engine per window size T (tokens,
look-ahead included; a bucket: shorter windows right-padded) over caches of S
committed tokens whose first `cached_len` rows are the valid ones, so every
call of one (slot, window) has the same shapes and addresses. A
`TrtEncoderSlot` is one request's device buffers (both stacks' K/V, zeroed:
free rows are masked, never NaN; both conv histories) with one execution
context per window whose tensor addresses are set once and whose enqueue
(window inputs up from pinned buffers, the engine, mu and spks down) is
captured once into a CUDA graph at load on the engine's GraphThread
(models/backends/tensorrt/graph.py); a refused capture leaves the plain
enqueue, with a warning. A `TrtStaticEncoderCache` borrows a slot for a
request's life; each call is one piece of work on the graph thread (replay,
then the committed rows of enc_window / up_window and the new conv histories
copied into the slot device-to-device), so the per-window buffers and the
contexts' activation memory are shared by all slots. A saved voice's prefix
is seeded by a device copy from the voice's copy on this GPU
(EncoderPrefix's PrefixRows, as static_flow.py seeds its rows).

A window longer than the largest bucket, or caches that outgrow the slot,
move the request once to a HostEncoderCache over the dynamic `flow_encoder`
engine (TrtSession.run takes host arrays: the committed rows are read back
into it with `HostEncoderCache.adopt`); requests beyond the pool use it from
the start. The pure decisions (bucket, fits, rows to copy) are
models/backends/fixed_shapes.py's.

Written against the TensorRT 10 Python API, type-checked against
tensorrt-stubs (tests/models/backends/test_trt_typing.py); never run: no
machine here has TensorRT (the `-m gpu` test in
tests/models/backends/test_trt_static.py is written for one)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.cuda import DeviceBuffer, ThreadCuda
from cosyedge_models.backends.encoder_cache import (
    EncoderCache,
    EncoderCacheSpec,
    EncoderCall,
    EncoderPrefix,
    HostEncoderCache,
    PooledEncoderCache,
)
from cosyedge_models.backends.fixed_shapes import (
    SlotPool,
    commit_copy,
    fixed_shape_names,
    fixed_shapes_wanted,
)
from cosyedge_models.backends.graph_thread import GraphThread
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
from cosyedge_models.backends.tensorrt.static_flow import copy_device_prefix
from cosyedge_models.bundle.loader import STATIC_ENCODER_PREFIX, Bundle
from cosyedge_models.errors import BundleError, SynthesisError

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

_INPUTS = ("token", "token_len", "lookahead_len", "cached_len", "commit_tokens", "embedding")  # uploaded per call
_OUTPUTS = ("mu", "spks", "enc_window", "up_window", "pre_cache_new", "upconv_cache_new")
_SLOT = ("enc_cache", "up_cache", "pre_cache", "upconv_cache")  # the slot's own device buffers
_FLOAT = ("embedding", *_OUTPUTS, *_SLOT)
WHAT = ("graph_flow on trt needs a bundle exported with 'cosyedge build export --static-flow-windows W,...' "
        "(this version's: it adds the encoder's graphs) and its engines built with 'cosyedge build engines'")


class _Window:
    """One window size's engine and the I/O buffers every slot binds."""

    def __init__(self, session: TrtSession) -> None:
        self.session = session
        shapes = static_shapes(session)
        missing = [n for n in (*_INPUTS, *_OUTPUTS, *_SLOT) if n not in shapes]
        if missing:
            raise SynthesisError(f"{session.name}: not a fixed-shape encoder engine (lacks {missing})")
        wrong = [n for n in _FLOAT if session.specs[n].dtype != np.float32]
        if wrong:  # the slots are fp32, as the graphs are exported
            raise SynthesisError(f"{session.name}: {wrong} are not fp32 in this engine")
        host = [n for n in _INPUTS if session.specs[n].host_side]
        if host:  # a captured graph replays device addresses only
            raise SynthesisError(f"{session.name}: {host} are shape tensors in this engine; rebuild it")
        self.window = int(shapes["token"][1])
        self.shapes = {n: shapes[n] for n in _SLOT}
        self.io = TensorBuffers(session, (*_INPUTS, *_OUTPUTS))

    def enqueue(self, ctx: trt.IExecutionContext, cuda: ThreadCuda) -> None:
        """What a slot's graph records: the window's inputs up, the engine, mu and spks down."""
        self.io.upload(cuda, _INPUTS)
        execute(self.session, ctx, cuda)
        self.io.download(cuda, ("mu", "spks"))


class TrtEncoderSlot:
    """One request's encoder buffers, with a captured run per window size."""

    def __init__(self, index: int, graphs: TrtStaticEncoder, cuda: ThreadCuda) -> None:
        spec = graphs.spec
        self.index = index
        self.enc_row = int(np.prod(spec.enc_row)) * 4
        self.up_row = int(np.prod(spec.up_row)) * 4
        r = spec.token_mel_ratio
        self.bufs = {"enc_cache": DeviceBuffer(graphs.cache_tokens * self.enc_row),
                     "up_cache": DeviceBuffer(r * graphs.cache_tokens * self.up_row),
                     "pre_cache": DeviceBuffer(int(np.prod(spec.pre_shape)) * 4),
                     "upconv_cache": DeviceBuffer(int(np.prod(spec.upconv_shape)) * 4)}
        for buf in self.bufs.values():
            cuda.zero(buf.ptr, buf.nbytes)
        self.runs: list[CapturedEnqueue] = []
        assert graphs.scratch is not None  # made by warm_up before the slots
        for win in graphs.io:
            ctx = user_context(win.session, graphs.scratch)
            set_addresses(win.session, ctx, {**{n: win.io.ptr(n) for n in (*_INPUTS, *_OUTPUTS)},
                                             **{n: b.ptr for n, b in self.bufs.items()}})
            self.runs.append(CapturedEnqueue(f"{win.session.name} slot {index}", ctx, cuda,
                                             functools.partial(win.enqueue, ctx, cuda)))

    def ptr(self, name: str) -> int:
        return self.bufs[name].ptr

    def zero_histories(self, cuda: ThreadCuda) -> None:
        """A zero conv history for the next borrower (its K/V rows are masked by cached_len)."""
        for name in ("pre_cache", "upconv_cache"):
            cuda.zero(self.bufs[name].ptr, self.bufs[name].nbytes)

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.bufs.values())

    def close(self) -> None:
        for run in self.runs:
            run.close()
        self.runs.clear()
        for buf in self.bufs.values():
            buf.close()


class TrtStaticEncoder(CapturedRuntime, SlotPool[TrtEncoderSlot]):
    """The fixed-shape encoder engines of one engine and their slot pool (one slot per
    request), run on `thread`. `__call__` is an EncoderCacheFactory: a
    TrtStaticEncoderCache while slots last, else a HostEncoderCache over the dynamic
    engine. `warm_up()` makes every slot and captures every (slot, window) before the
    engine serves."""

    what = "fixed-shape flow encoder engines"

    def __init__(self, sessions: Sequence[TrtSession], spec: EncoderCacheSpec, max_slots: int, thread: GraphThread,
                 capture: bool = True) -> None:
        CapturedRuntime.__init__(self, sessions, thread, capture)
        SlotPool.__init__(self, max_slots, thread)
        self.spec = spec
        self.io: list[_Window] = []
        self.windows: list[int] = []
        self.cache_tokens = 0

    def _make(self, cuda: ThreadCuda, scratch: DeviceBuffer) -> None:
        self.io = sorted((_Window(s) for s in self._sessions), key=lambda w: w.window)
        self.windows = [w.window for w in self.io]
        self.cache_tokens = self._check_shapes()
        for win in self.io:  # defined inputs for the warm-up runs: no tokens, no cached rows
            win.io.zero_host()
        while self.slot_count < self.max_slots:
            slot = TrtEncoderSlot(self.slot_count, self, cuda)
            self.register(slot)  # freed by close() even if its warm-up fails (which disables the pool)
            for run in slot.runs:
                self.prepare(run)

    def _check_shapes(self) -> int:
        """The committed tokens the engines cache (S); a SynthesisError unless every window's
        caches are S tokens of this bundle's spec."""
        spec, r = self.spec, self.spec.token_mel_ratio
        found = {(w.shapes["enc_cache"], w.shapes["up_cache"], w.shapes["pre_cache"], w.shapes["upconv_cache"])
                 for w in self.io}
        s = self.io[0].shapes["enc_cache"][0]
        want = ((s, *spec.enc_row), (r * s, *spec.up_row), spec.pre_shape, spec.upconv_shape)
        if found != {want}:
            raise SynthesisError(f"fixed-shape encoder engines with cache shapes {sorted(found)}, expected {want}")
        return s

    def acquire(self, spec: EncoderCacheSpec) -> TrtEncoderSlot | None:
        if self.disabled is not None or spec != self.spec:
            return None  # the engines bake in this bundle's chunk and shapes
        return self.take_slot()

    def __call__(self, session: Session, spec: EncoderCacheSpec) -> EncoderCache:
        slot = self.acquire(spec)
        if slot is None:
            return HostEncoderCache(session, spec)
        return TrtStaticEncoderCache(self, slot, session)

    def _dispose(self) -> None:
        for slot in self.drop_slots():
            slot.close()
        for win in self.io:
            win.io.close()


class TrtStaticEncoderCache(PooledEncoderCache[TrtEncoderSlot]):
    """EncoderCache on a TrtEncoderSlot; moves to a HostEncoderCache over the dynamic
    engine when a call does not fit the fixed shapes."""

    def __init__(self, graphs: TrtStaticEncoder, slot: TrtEncoderSlot, dynamic: Session) -> None:
        super().__init__(graphs, slot, dynamic, graphs.spec)
        self._graphs = graphs

    def _replay(self, slot: TrtEncoderSlot, call: EncoderCall) -> tuple[np.ndarray, np.ndarray]:
        return _replay(self._graphs, slot, call)

    def _read_back(self, slot: TrtEncoderSlot, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        spec = self.spec
        enc = np.empty((tokens, *spec.enc_row), np.float32)
        up = np.empty((spec.token_mel_ratio * tokens, *spec.up_row), np.float32)
        pre, upconv = np.empty(spec.pre_shape, np.float32), np.empty(spec.upconv_shape, np.float32)
        cuda = thread_cuda(self._graphs.device_id)
        for dst, name in ((enc, "enc_cache"), (up, "up_cache"), (pre, "pre_cache"), (upconv, "upconv_cache")):
            if dst.size:
                cuda.dtoh(dst, slot.ptr(name))
        cuda.synchronize()
        return enc, up, pre, upconv

    def _seed(self, slot: TrtEncoderSlot, prefix: EncoderPrefix) -> None:
        """The rows by device copy from the voice's copy on this GPU, the conv histories uploaded."""
        graphs = self._graphs
        cuda = thread_cuda(graphs.device_id)
        for rows, name in ((prefix.enc, "enc_cache"), (prefix.up, "up_cache")):
            copy_device_prefix(cuda, graphs.device_id, slot.ptr(name), rows)
        cuda.htod(slot.ptr("pre_cache"), np.ascontiguousarray(prefix.pre, dtype=np.float32))
        cuda.htod(slot.ptr("upconv_cache"), np.ascontiguousarray(prefix.upconv, dtype=np.float32))
        cuda.synchronize()

    def _reset(self, slot: TrtEncoderSlot) -> None:
        cuda = thread_cuda(self._graphs.device_id)
        slot.zero_histories(cuda)
        cuda.synchronize()


def _replay(graphs: TrtStaticEncoder, slot: TrtEncoderSlot, call: EncoderCall) -> tuple[np.ndarray, np.ndarray]:
    """One call on the graph thread: inputs in, replay, committed rows into the slot, mu and spks out."""
    win = graphs.io[call.window]
    io = win.io
    n = call.tokens.shape[0]
    token = io.host("token")
    token[...] = 0  # padded tokens: zeroed and masked
    token[0, :n] = call.tokens
    io.host("token_len")[...] = n
    io.host("lookahead_len")[...] = call.lookahead
    io.host("cached_len")[...] = call.cached
    io.host("commit_tokens")[...] = call.commit
    io.host("embedding")[...] = call.embedding[None]
    cuda = thread_cuda(graphs.device_id)
    slot.runs[call.window].run()
    copy = commit_copy(call.cached, call.commit)
    if copy is not None:  # the window's first `commit` tokens' rows, and r per token up-sampled
        r = graphs.spec.token_mel_ratio
        cuda.dtod(slot.ptr("enc_cache") + copy.dst * slot.enc_row, io.ptr("enc_window") + copy.src * slot.enc_row,
                  copy.nbytes(slot.enc_row))
        cuda.dtod(slot.ptr("up_cache") + r * copy.dst * slot.up_row, io.ptr("up_window") + r * copy.src * slot.up_row,
                  r * copy.nbytes(slot.up_row))
        for new, old in (("pre_cache_new", "pre_cache"), ("upconv_cache_new", "upconv_cache")):
            cuda.dtod(slot.ptr(old), io.ptr(new), slot.bufs[old].nbytes)
    cuda.synchronize()
    frames = graphs.spec.token_mel_ratio * (n - call.lookahead)
    mu = np.array(io.host("mu")[:, :, :frames])
    spks = np.array(io.host("spks"))
    graphs.replays += 1
    return mu, spks


def load_trt_static_encoder(bundle: Bundle, backend_name: str, load: Callable[[str], Session], setting: bool | None,
                            slots: int, spec: EncoderCacheSpec,
                            graph_thread: Callable[[], GraphThread]) -> TrtStaticEncoder | None:
    """The engine's fixed-shape encoder engines with `slots` requests' worth of device
    caches, made and captured now on the graph thread, or None (the dynamic engine only).
    `setting` as graph_flow's (the estimator's engines and these go together; their
    slots are the estimator's request slots, whose count the auto setting already fitted)."""
    names = fixed_shape_names(bundle.stages, STATIC_ENCODER_PREFIX)
    if not (fixed_shapes_wanted(names, setting, backend_name, bundle.root, WHAT) and backend_name == "trt"):
        return None
    chunks = {int(bundle.stages[n].raw.get("chunk_tokens", -1)) for n in names}
    if chunks != {spec.chunk_tokens}:
        raise BundleError(f"{bundle.root}: fixed-shape encoder graphs for chunks {sorted(chunks)} (the bundle "
                          f"streams {spec.chunk_tokens}-token chunks); re-export")
    sessions = [load(n) for n in names]
    trt_sessions = [s for s in sessions if isinstance(s, TrtSession)]
    if len(trt_sessions) != len(sessions):
        return None  # a wrapped backend (tests): the dynamic engine
    graphs = TrtStaticEncoder(trt_sessions, spec, slots, graph_thread())
    graphs.warm_up()
    log.info("flow encoder: fixed-shape TensorRT engines for windows %s tokens over %d cached tokens, %d request "
             "slots%s%s", graphs.windows, graphs.cache_tokens, slots, ", CUDA graphs" if graphs.capture else "",
             f" (disabled: {graphs.disabled})" if graphs.disabled else "")
    return graphs
