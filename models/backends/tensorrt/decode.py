"""The LLM decode loop on TensorRT: the KV cache stays on the device.

Per worker thread (allocated once, on the thread's first loop, and reused by
every request the thread runs): two device buffers `a`/`b` sized for the
longest cache (past and present), the attention-mask buffers, the
input-embedding and logp buffers with page-locked host twins, the execution
contexts and the CUDA graphs. Per step only the new token's embedding goes to
the device and only logp ([1, V]) comes back.

Contexts: the prefill's, the exact-mode step's and one per decode bucket, all
on one user-managed activation buffer (the largest engine's
device_memory_size_v2): they run one after another on the thread's stream,
so one scratch serves them all instead of an arena each.

CUDA graphs: the contract's decode graph takes a past of growing length, and
a captured graph replays fixed shapes and addresses only. So with graphs on
(the default), the cache is laid out at fixed bucket lengths (64, 128, ...,
the profile's max) with the attention mask zeroing the padding
(models/backends/kv_layout.py explains the layout): within a bucket every
step has the same shapes and buffers, and one graph per bucket holds the
embedding upload, execute_async_v3 and the logp download. Every bucket's
graph is captured when the thread's resources are made, before its first
request (after one plain warm-up enqueue each, as TensorRT requires), on the
thread's non-blocking stream in thread-local capture mode, so work other
threads run meanwhile cannot invalidate a capture. With graphs off, or if a
capture fails, the loop runs the exact past length with the two buffers
swapping roles (ping-pong) and a plain enqueue per step.

A loop uses the contexts of the thread that made it: prefill() and step()
refuse to run on another thread."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from cosyedge_models.backends.cuda import CudaGraph, DeviceBuffer, free_pinned, pinned_empty
from cosyedge_models.backends.kv_layout import Copy2D, KvPlan, MaskFill, MaskSet, bucket_mask, decode_buckets
from cosyedge_models.backends.profiles import choose_profile
from cosyedge_models.backends.tensorrt.graph import scratch_bytes, user_context
from cosyedge_models.backends.tensorrt.session import IoBuffers, TrtSession, dims
from cosyedge_models.errors import SynthesisError

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

_PREFILL_IN = ("inputs_embeds", "attention_mask")
_DECODE_IN = ("inputs_embeds", "attention_mask", "past_kv")
_OUT = ("logp", "present_kv")


@dataclass
class LoopContext:
    """A context on the thread's decode scratch and the profile it has selected."""

    context: trt.IExecutionContext
    profile: int = -1


@dataclass
class DecodeResources:
    """One thread's device memory, contexts and graphs for decoding; lives in the
    decode session's per-thread state and is freed with it."""

    thread: int  # the thread whose stream and contexts these are
    prefill_engine: trt.ICudaEngine  # made for this prefill engine (with the decode session's)
    vocab: int  # V of logp [1, V]
    mask_dtype: np.dtype
    scratch: DeviceBuffer  # every context's activation memory (they run one after another)
    kv: dict[str, DeviceBuffer]
    ones: DeviceBuffer  # ones of mask_dtype: the prefill mask and the exact-mode decode mask
    mask: IoBuffers  # the bucketed-mode decode mask
    one: np.ndarray  # page-locked [1] = 1 of mask_dtype, source of MaskSet
    prefill_embeds: IoBuffers
    step_embeds: IoBuffers
    logp: IoBuffers
    prefill_ctx: LoopContext
    step_ctx: LoopContext  # the exact (ungraphed) mode's
    contexts: dict[int, trt.IExecutionContext] = field(default_factory=dict)  # bucket -> its context
    graphs: dict[int, CudaGraph] = field(default_factory=dict)  # bucket -> its captured step
    graphs_failed: bool = False

    def nbytes(self) -> int:
        pinned = (self.mask, self.prefill_embeds, self.step_embeds, self.logp)
        return (self.scratch.nbytes + sum(b.nbytes for b in self.kv.values()) + self.ones.nbytes
                + self.one.nbytes + sum(p.nbytes() for p in pinned))

    def close(self) -> None:
        for g in self.graphs.values():
            g.close()
        self.graphs.clear()
        self.contexts.clear()  # TensorRT frees a context when its last reference goes
        for b in (*self.kv.values(), self.ones, self.scratch):
            b.close()
        for p in (self.mask, self.prefill_embeds, self.step_embeds, self.logp):
            p.close()
        if self.one.size:
            free_pinned(self.one, self.scratch.device_id)
            self.one = self.one[:0]


def _profile_indices(sess: TrtSession, prefill: bool) -> list[int]:
    """The session's profiles for a prefill (several new positions) or for the steps (one)."""
    return [i for i, p in enumerate(sess.profiles) if (p["inputs_embeds"].max[1] > 1) == prefill]


class TrtDecodeLoop:
    """DecodeLoop over the llm_prefill / llm_decode engines, batch 1. With one LLM
    engine (`prefill.engine is decode.engine`: `build engines` recorded llm_prefill
    as llm_decode's engine, one copy of the weights) the prefill runs llm_decode's
    prefill profile over an empty past, or over a saved voice's prefix (`takes_past`).
    Made on, and used from, one thread."""

    def __init__(self, prefill: TrtSession, decode: TrtSession, *, use_graphs: bool = True) -> None:
        self.one_engine = prefill.engine is decode.engine
        for sess, ins in ((prefill, _DECODE_IN if self.one_engine else _PREFILL_IN), (decode, _DECODE_IN)):
            if set(sess.input_names) != set(ins) or not set(_OUT) <= set(sess.output_names):
                raise SynthesisError(f"{sess.name}: engine I/O {sess.input_names} -> {sess.output_names} is not the "
                                  f"LLM contract (inputs {ins}, outputs {_OUT}); re-export the bundle")
        self._pre, self._dec = prefill, decode
        kv_spec = decode.specs["past_kv"]
        if prefill.specs["present_kv"].dtype != kv_spec.dtype or decode.specs["present_kv"].dtype != kv_spec.dtype:
            raise SynthesisError("llm_prefill and llm_decode disagree on the KV cache dtype; rebuild the engines")
        self._kv_dtype = kv_spec.dtype
        # the attention mask's dtype as the engines declare it (the contract exports int64)
        self._mask_dtype = decode.specs["attention_mask"].dtype
        if prefill.specs["attention_mask"].dtype != self._mask_dtype:
            raise SynthesisError(f"llm_prefill takes a {prefill.specs['attention_mask'].dtype} attention mask, "
                                 f"llm_decode a {self._mask_dtype} one; rebuild the engines")
        self._steps = _profile_indices(decode, prefill=False)
        self._prefills = _profile_indices(prefill, prefill=True) if self.one_engine else \
            list(range(len(prefill.profiles)))
        if not self._steps or not self._prefills:
            raise SynthesisError("the LLM engines have no step profile (one new position) or no prefill profile; "
                                 "rebuild the engines")
        past = decode.profiles[self._steps[0]]["past_kv"]
        self._kv_shape = past.max  # [L, 2, B, Hkv, Pmax, hd]; the loop runs B = 1
        layers, two, _, heads, _, head_dim = self._kv_shape
        self._p_max = max(decode.profiles[i]["past_kv"].max[4] for i in self._steps)
        p_min = min(decode.profiles[i]["past_kv"].min[4] for i in self._steps)
        self._t_max = max(prefill.profiles[i]["inputs_embeds"].max[1] for i in self._prefills)
        # a saved prefix's positions the prefill profile takes (0: the prefill starts empty)
        self._prefix_max = max(prefill.profiles[i]["past_kv"].max[4] for i in self._prefills) \
            if self.one_engine else 0
        self.takes_past = self._prefix_max >= 1
        self._hidden = decode.profiles[self._steps[0]]["inputs_embeds"].max[2]
        buckets = decode_buckets(p_min, self._p_max) if use_graphs else None
        self.plan = KvPlan(layers * two * heads, head_dim, self._kv_dtype.itemsize, self._p_max, buckets)
        self._pst = prefill.state()
        self._dst = decode.state()
        if self._pst.cuda is not self._dst.cuda:
            raise SynthesisError("llm_prefill and llm_decode must run on the same thread")
        self._res = self._resources()
        self._started = False

    # --- per-thread resources -------------------------------------------------------------
    def _resources(self) -> DecodeResources:
        res = self._dst.extras.get("decode")
        if isinstance(res, DecodeResources):
            if res.prefill_engine is self._pre.engine:
                return res
            self._dst.extras.pop("decode").close()  # made with another prefill engine
        layers, two, _, heads, _, head_dim = self._kv_shape
        positions = max(self.plan.capacity_positions(), self._t_max + self._prefix_max)
        kv_bytes = layers * two * heads * positions * head_dim * self._kv_dtype.itemsize
        ones_len = max(self._t_max + self._prefix_max, self._p_max + 1)
        msize = self._mask_dtype.itemsize
        emb_pre = self._pre.specs["inputs_embeds"].dtype
        emb_dec = self._dec.specs["inputs_embeds"].dtype
        logp_itemsize = max(self._dec.specs["logp"].dtype.itemsize, self._pre.specs["logp"].dtype.itemsize)
        cuda = self._dst.cuda
        scratch = DeviceBuffer(scratch_bytes((self._pre, self._dec)))
        step_ctx = LoopContext(user_context(self._dec, scratch))
        vocab = self._logp_width(step_ctx)
        res = DecodeResources(
            thread=cuda.thread,
            prefill_engine=self._pre.engine,
            vocab=vocab,
            mask_dtype=self._mask_dtype,
            scratch=scratch,
            kv={"a": DeviceBuffer(kv_bytes), "b": DeviceBuffer(kv_bytes)},
            ones=DeviceBuffer(ones_len * msize),
            mask=IoBuffers.allocate((self._p_max + 1) * msize),
            one=pinned_empty(msize).view(self._mask_dtype),
            prefill_embeds=IoBuffers.allocate(self._t_max * self._hidden * emb_pre.itemsize),
            step_embeds=IoBuffers.allocate(self._hidden * emb_dec.itemsize),
            logp=IoBuffers.allocate(vocab * logp_itemsize),
            prefill_ctx=LoopContext(user_context(self._pre, scratch)),
            step_ctx=step_ctx,
        )
        self._dst.extras["decode"] = res  # freed with the session's thread state, also if the rest fails
        res.one[0] = 1
        ones_host = pinned_empty(ones_len * msize)
        ones_host.view(self._mask_dtype)[:] = 1
        cuda.htod(res.ones.ptr, ones_host)
        res.step_embeds.host[...] = 0
        res.mask.host[...] = 0
        cuda.htod(res.mask.device.ptr, res.mask.host)
        if self.plan.buckets:
            self._capture_buckets(res)
        # Bucket padding is masked, but 0 x NaN is NaN: the caches must never
        # hold NaN/Inf bit patterns, so they start zeroed (after the warm-up steps
        # above; afterwards only KV values are ever written into them).
        for buf in res.kv.values():
            cuda.zero(buf.ptr, buf.nbytes)
        cuda.synchronize()
        free_pinned(ones_host, self._dst.cuda.device_id)
        return res

    def _logp_width(self, step: LoopContext) -> int:
        """V, read from a step context's output shape at the smallest past."""
        prof = self._dec.profiles[self._steps[0]]
        self._select(step, self._steps[0], self._dec)
        for n, r in prof.items():
            step.context.set_input_shape(n, r.min)
        shape = dims(step.context.get_tensor_shape("logp"))
        if len(shape) != 2 or shape[1] < 1:
            raise SynthesisError(f"llm_decode: logp shape {shape} is not [B, V]")
        return int(shape[1])

    def _capture_buckets(self, res: DecodeResources) -> None:
        """A context per decode bucket, bound at that bucket's shapes, and its step captured
        into a CUDA graph (after the plain warm-up enqueue TensorRT wants before a capture)."""
        assert self.plan.buckets is not None
        for pb in self.plan.buckets:
            ctx = self._bucket_context(res, pb)
            res.contexts[pb] = ctx
            self._enqueue_step(res, ctx)
            if not res.graphs_failed:
                self._capture(res, pb, ctx)

    def _bucket_context(self, res: DecodeResources, pb: int) -> trt.IExecutionContext:
        kv_shape = self._kv_step_shape(pb)
        profile = self._step_profile(kv_shape)
        ctx = user_context(self._dec, res.scratch)
        if not ctx.set_optimization_profile_async(profile, self._dst.cuda.handle):
            raise SynthesisError(f"llm_decode: cannot select optimization profile {profile}")
        self._bind_step(res, ctx, kv_shape, "a", "b", res.mask.device.ptr)
        return ctx

    def _kv_step_shape(self, past: int) -> tuple[int, ...]:
        layers, two, _, heads, _, head_dim = self._kv_shape
        return (layers, two, 1, heads, past, head_dim)

    def _step_profile(self, kv_shape: tuple[int, ...]) -> int:
        """Among the step profiles only: with one engine the prefill profile covers short pasts too."""
        sess = self._dec
        return self._steps[choose_profile([sess.profiles[i] for i in self._steps],
                                          {"inputs_embeds": (1, 1, self._hidden),
                                           "attention_mask": (1, kv_shape[4] + 1), "past_kv": kv_shape}, sess.name)]

    def _select(self, lc: LoopContext, profile: int, sess: TrtSession) -> None:
        if lc.profile != profile:
            if not lc.context.set_optimization_profile_async(profile, self._dst.cuda.handle):
                raise SynthesisError(f"{sess.name}: cannot select optimization profile {profile}")
            lc.profile = profile

    def _check_thread(self) -> None:
        here = threading.get_ident()
        if here != self._res.thread:
            raise SynthesisError(f"llm_decode: this TensorRT decode loop was made on thread {self._res.thread} and "
                                 f"runs that thread's contexts and stream; it was called from thread {here} "
                                 "(make the loop on the thread that runs it: backend.decode_loop)")

    # --- DecodeLoop ---------------------------------------------------------------------------
    @property
    def cache_len(self) -> int:
        return self.plan.past_len if self._started else 0

    def prefill(self, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        self._check_thread()
        if past is not None and not self.takes_past:
            raise SynthesisError("these TensorRT engines do not start from a saved cache (takes_past is False: "
                                 "llm_prefill is its own engine); rebuild them from a current export")
        b, t, d = inputs_embeds.shape
        if b != 1:
            raise SynthesisError(f"the TensorRT decode loop runs one request at a time (batch 1), got batch {b}")
        if t > self._t_max:
            raise SynthesisError(f"llm_prefill: prompt of {t} positions exceeds the engine's maximum of {self._t_max}; "
                              "rebuild the engines with a larger llm_prefill profile or send shorter text")
        n_past = int(past.shape[4]) if past is not None else 0
        if n_past > self._prefix_max:
            raise SynthesisError(f"llm_prefill: a saved prefix of {n_past} positions exceeds the engine's maximum of "
                                 f"{self._prefix_max}")
        res, sess, cuda = self._res, self._pre, self._dst.cuda
        shapes: dict[str, tuple[int, ...]] = {"inputs_embeds": (1, t, d), "attention_mask": (1, n_past + t)}
        if self.one_engine:
            shapes["past_kv"] = self._kv_step_shape(n_past)
        chosen = choose_profile([sess.profiles[i] for i in self._prefills], shapes, sess.name)
        self._select(res.prefill_ctx, self._prefills[chosen], sess)
        ctx = res.prefill_ctx.context
        emb = res.prefill_embeds.view(sess.specs["inputs_embeds"].dtype, (1, t, d))
        emb[...] = inputs_embeds
        cuda.htod(res.prefill_embeds.device.ptr, emb)
        for name, shape in shapes.items():
            if not ctx.set_input_shape(name, shape):
                raise SynthesisError(f"{sess.name}: TensorRT rejected the prefill shape {name} {shape}")
        if self.one_engine:
            if past is not None:  # the voice's prefix, contiguous [L, 2, 1, Hkv, P, hd], into buffer a
                cuda.htod(res.kv["a"].ptr, np.ascontiguousarray(past, dtype=self._kv_dtype))
            # an empty past (P = 0) still gets a valid address
            ctx.set_tensor_address("past_kv", res.kv["a"].ptr)
        ctx.set_tensor_address("inputs_embeds", res.prefill_embeds.device.ptr)
        ctx.set_tensor_address("attention_mask", res.ones.ptr)
        ctx.set_tensor_address("logp", res.logp.device.ptr)
        ctx.set_tensor_address("present_kv", res.kv["b"].ptr)
        if not ctx.execute_async_v3(cuda.handle):
            raise SynthesisError(f"{sess.name}: TensorRT execution failed (see the TensorRT log above)")
        logp = self._download_logp(sess)
        self._apply(self.plan.start(n_past + t))
        self._started = True
        return logp

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        if not self._started:
            raise RuntimeError("step() before prefill()")
        self._check_thread()
        res, sess, plan = self._res, self._dec, self.plan
        d = inputs_embeds.shape[-1]
        emb = res.step_embeds.view(sess.specs["inputs_embeds"].dtype, (1, 1, d))
        emb[...] = inputs_embeds
        if plan.bucketed:
            # One execution context per bucket, bound and captured when the resources were
            # made: a replayed graph relies on the context's per-shape state.
            pb = plan.past_dim
            graph = res.graphs.get(pb)
            if graph is not None:
                graph.launch(self._dst.cuda.handle)
            else:
                self._enqueue_step(res, res.contexts[pb])
        else:
            kv_shape = self._kv_step_shape(plan.past_dim)
            self._select(res.step_ctx, self._step_profile(kv_shape), sess)
            self._bind_step(res, res.step_ctx.context, kv_shape, plan.past_buf, plan.present_buf, res.ones.ptr)
            self._enqueue_step(res, res.step_ctx.context)
        logp = self._download_logp(sess, enqueue=False)
        self._apply(plan.advance())
        return logp

    def close(self) -> None:
        # The per-thread buffers, contexts and graphs stay for the thread's next request;
        # the last step's cache copies finish now, so nothing of this request stays queued.
        if self._started:
            self._dst.cuda.synchronize()
        self._started = False

    # --- internals ----------------------------------------------------------------------------
    def _bind_step(self, res: DecodeResources, ctx: trt.IExecutionContext, kv_shape: tuple[int, ...],
                   past_buf: str, present_buf: str, mask_ptr: int) -> None:
        ok = (ctx.set_input_shape("inputs_embeds", (1, 1, self._hidden))
              and ctx.set_input_shape("attention_mask", (1, kv_shape[4] + 1))
              and ctx.set_input_shape("past_kv", kv_shape))
        if not ok:
            raise SynthesisError(f"llm_decode: TensorRT rejected the step shapes (past {kv_shape})")
        ctx.set_tensor_address("inputs_embeds", res.step_embeds.device.ptr)
        ctx.set_tensor_address("attention_mask", mask_ptr)
        ctx.set_tensor_address("past_kv", res.kv[past_buf].ptr)
        ctx.set_tensor_address("present_kv", res.kv[present_buf].ptr)
        ctx.set_tensor_address("logp", res.logp.device.ptr)

    def _enqueue_step(self, res: DecodeResources, ctx: trt.IExecutionContext) -> None:
        cuda = self._dst.cuda
        emb = res.step_embeds
        cuda.htod(emb.device.ptr, emb.host[:emb.device.nbytes])
        if not ctx.execute_async_v3(cuda.handle):
            raise SynthesisError("llm_decode: TensorRT execution failed (see the TensorRT log above)")
        cuda.dtoh(res.logp.host[:res.logp.device.nbytes], res.logp.device.ptr)

    def _capture(self, res: DecodeResources, pb: int, ctx: trt.IExecutionContext) -> None:
        """Record upload + execute + download for this bucket; the warm-up
        enqueue just ran, so TensorRT's deferred per-shape setup is done."""
        cuda = self._dst.cuda
        cuda.synchronize()
        try:
            cuda.graphs.begin(cuda.handle)
            try:
                self._enqueue_step(res, ctx)
            except Exception:
                cuda.graphs.abort(cuda.handle)
                raise
            res.graphs[pb] = cuda.graphs.end(cuda.handle)
        except Exception as exc:  # a capture failure must not fail the request
            res.graphs_failed = True
            log.warning("llm_decode: CUDA graph capture failed (%s); continuing without graphs", exc)

    def _download_logp(self, sess: TrtSession, enqueue: bool = True) -> np.ndarray:
        res, cuda = self._res, self._dst.cuda
        if enqueue:
            cuda.dtoh(res.logp.host[:res.logp.device.nbytes], res.logp.device.ptr)
        cuda.synchronize()
        return res.logp.view(sess.specs["logp"].dtype, (1, res.vocab)).copy()

    def _apply(self, ops: list[Copy2D | MaskSet | MaskFill]) -> None:
        res, cuda = self._res, self._dst.cuda
        size = res.mask_dtype.itemsize
        for op in ops:
            if isinstance(op, Copy2D):
                cuda.copy_2d(res.kv[op.dst].ptr + op.dst_offset, op.dst_pitch,
                             res.kv[op.src].ptr + op.src_offset, op.src_pitch, op.width, op.height)
            elif isinstance(op, MaskSet):
                cuda.htod(res.mask.device.ptr + size * op.index, res.one)
            else:
                cuda.synchronize()  # the pinned mask may still feed an earlier upload
                host = res.mask.view(res.mask_dtype, (1, op.bucket + 1))
                host[...] = bucket_mask(op.valid, op.bucket)
                cuda.htod(res.mask.device.ptr, host)
