"""The LLM decode loop on TensorRT: the KV cache stays on the device.

Per worker thread (allocated once, reused by every request the thread runs):
two device buffers `a`/`b` sized for the longest cache (past and present),
the attention-mask buffer, the input-embedding and logp buffers with pinned
host twins, and the CUDA graphs. Per step only the new token's embedding
goes to the device and only logp ([1, V]) comes back.

CUDA graphs: the contract's decode graph takes a past of growing length, and
a captured graph replays fixed shapes and addresses only. So with graphs on
(the default), the cache is laid out at fixed bucket lengths (64, 128, ...,
the profile's max) with the attention mask zeroing the padding
(models/backends/kv_layout.py explains the layout): within a bucket every
step has the same shapes and buffers, and one graph per bucket (captured on
its first step, after a normal warm-up enqueue, as TensorRT requires) holds
the embedding upload, execute_async_v3 and the logp download. With graphs
off, or if a capture fails, the loop runs the exact past length with the two
buffers swapping roles (ping-pong) and a plain enqueue per step."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from cosyedge_models.backends.cuda import CudaGraph, DeviceBuffer, pinned_empty
from cosyedge_models.backends.kv_layout import Copy2D, KvPlan, MaskFill, MaskSet, bucket_mask, decode_buckets
from cosyedge_models.backends.profiles import choose_profile
from cosyedge_models.backends.tensorrt.session import TrtSession, dims
from cosyedge_models.errors import SynthesisError

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

_PREFILL_IN = ("inputs_embeds", "attention_mask")
_DECODE_IN = ("inputs_embeds", "attention_mask", "past_kv")
_OUT = ("logp", "present_kv")


@dataclass
class _Pinned:
    device: DeviceBuffer
    host: np.ndarray  # pinned bytes

    def view(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape)) * dtype.itemsize
        return self.host[:n].view(dtype).reshape(shape)


@dataclass
class DecodeResources:
    """One thread's device memory for decoding; lives in the decode
    session's per-thread state and is freed with it."""

    kv: dict[str, DeviceBuffer]
    ones: DeviceBuffer  # int64 ones: the prefill mask and the exact-mode decode mask
    mask: _Pinned  # the bucketed-mode decode mask
    one: np.ndarray  # pinned int64 [1] = 1, source of MaskSet
    prefill_embeds: _Pinned
    step_embeds: _Pinned
    logp: _Pinned
    contexts: dict[tuple[int, int], trt.IExecutionContext] = field(default_factory=dict)  # (profile, bucket)
    graphs: dict[tuple[int, int], CudaGraph] = field(default_factory=dict)
    graphs_failed: bool = False

    def nbytes(self) -> int:
        pinned = (self.mask, self.prefill_embeds, self.step_embeds, self.logp)
        return (sum(b.nbytes for b in self.kv.values()) + self.ones.nbytes
                + sum(p.device.nbytes + p.host.nbytes for p in pinned))

    def close(self) -> None:
        for g in self.graphs.values():
            g.close()
        self.graphs.clear()
        self.contexts.clear()  # TensorRT frees a context when its last reference goes
        for b in (*self.kv.values(), self.ones, self.mask.device, self.prefill_embeds.device,
                  self.step_embeds.device, self.logp.device):
            b.close()


def _pinned(nbytes: int) -> _Pinned:
    return _Pinned(DeviceBuffer(nbytes), pinned_empty(nbytes))


def _profile_indices(sess: TrtSession, prefill: bool) -> list[int]:
    """The session's profiles for a prefill (several new positions) or for the steps (one)."""
    return [i for i, p in enumerate(sess.profiles) if (p["inputs_embeds"].max[1] > 1) == prefill]


class TrtDecodeLoop:
    """DecodeLoop over the llm_prefill / llm_decode engines, batch 1. With one LLM
    engine (`prefill.engine is decode.engine`: `build engines` recorded llm_prefill
    as llm_decode's engine, one copy of the weights) the prefill runs llm_decode's
    prefill profile over an empty past, or over a saved voice's prefix (`takes_past`)."""

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
        self._vocab = 0
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
            return res
        layers, two, _, heads, _, head_dim = self._kv_shape
        positions = max(self.plan.capacity_positions(), self._t_max + self._prefix_max)
        kv_bytes = layers * two * heads * positions * head_dim * self._kv_dtype.itemsize
        ones_len = max(self._t_max + self._prefix_max, self._p_max + 1)
        emb_pre = self._pre.specs["inputs_embeds"].dtype
        emb_dec = self._dec.specs["inputs_embeds"].dtype
        logp_itemsize = max(self._dec.specs["logp"].dtype.itemsize, self._pre.specs["logp"].dtype.itemsize)
        vocab = self._logp_width()
        res = DecodeResources(
            kv={"a": DeviceBuffer(kv_bytes), "b": DeviceBuffer(kv_bytes)},
            ones=DeviceBuffer(ones_len * 8),
            mask=_pinned((self._p_max + 1) * 8),
            one=pinned_empty(8).view(np.int64),
            prefill_embeds=_pinned(self._t_max * self._hidden * emb_pre.itemsize),
            step_embeds=_pinned(self._hidden * emb_dec.itemsize),
            logp=_pinned(vocab * logp_itemsize),
        )
        res.one[0] = 1
        ones_host = pinned_empty(ones_len * 8).view(np.int64)
        ones_host[:] = 1
        cuda = self._dst.cuda
        cuda.htod(res.ones.ptr, ones_host)
        # Bucket padding is masked, but 0 x NaN is NaN: the caches must never
        # hold NaN/Inf bit patterns, so they start zeroed (afterwards only KV
        # values are ever written into them).
        for buf in res.kv.values():
            cuda.zero(buf.ptr, buf.nbytes)
        cuda.synchronize()
        self._dst.extras["decode"] = res
        return res

    def _logp_width(self) -> int:
        """V, read from the decode context's output shape at the smallest past."""
        st, sess = self._dst, self._dec
        prof = sess.profiles[self._steps[0]]
        sess.select_profile(st, self._steps[0])
        for n, r in prof.items():
            st.context.set_input_shape(n, r.min)
        shape = dims(st.context.get_tensor_shape("logp"))
        if len(shape) != 2 or shape[1] < 1:
            raise SynthesisError(f"llm_decode: logp shape {shape} is not [B, V]")
        self._vocab = int(shape[1])
        return self._vocab

    # --- DecodeLoop ---------------------------------------------------------------------------
    @property
    def cache_len(self) -> int:
        return self.plan.past_len if self._started else 0

    def prefill(self, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
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
        res, st, sess = self._res, self._pst, self._pre
        layers, two, _, heads, _, head_dim = self._kv_shape
        shapes: dict[str, tuple[int, ...]] = {"inputs_embeds": (1, t, d), "attention_mask": (1, n_past + t)}
        if self.one_engine:
            shapes["past_kv"] = (layers, two, 1, heads, n_past, head_dim)
        chosen = choose_profile([sess.profiles[i] for i in self._prefills], shapes, sess.name)
        sess.select_profile(st, self._prefills[chosen])
        ctx = st.context
        emb = res.prefill_embeds.view(sess.specs["inputs_embeds"].dtype, (1, t, d))
        emb[...] = inputs_embeds
        st.cuda.htod(res.prefill_embeds.device.ptr, emb)
        for name, shape in shapes.items():
            if not ctx.set_input_shape(name, shape):
                raise SynthesisError(f"{sess.name}: TensorRT rejected the prefill shape {name} {shape}")
        if self.one_engine:
            if past is not None:  # the voice's prefix, contiguous [L, 2, 1, Hkv, P, hd], into buffer a
                st.cuda.htod(res.kv["a"].ptr, np.ascontiguousarray(past, dtype=self._kv_dtype))
            # an empty past (P = 0) still gets a valid address
            ctx.set_tensor_address("past_kv", res.kv["a"].ptr)
        ctx.set_tensor_address("inputs_embeds", res.prefill_embeds.device.ptr)
        ctx.set_tensor_address("attention_mask", res.ones.ptr)
        ctx.set_tensor_address("logp", res.logp.device.ptr)
        ctx.set_tensor_address("present_kv", res.kv["b"].ptr)
        sess.execute(st)
        logp = self._download_logp(sess)
        self._apply(self.plan.start(n_past + t))
        self._started = True
        return logp

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        if not self._started:
            raise RuntimeError("step() before prefill()")
        res, st, sess, plan = self._res, self._dst, self._dec, self.plan
        d = inputs_embeds.shape[-1]
        pd = plan.past_dim
        layers, two, _, heads, _, head_dim = self._kv_shape
        kv_shape = (layers, two, 1, heads, pd, head_dim)
        # among the step profiles only: with one engine the prefill profile covers short pasts too
        profile = self._steps[choose_profile([sess.profiles[i] for i in self._steps],
                                             {"inputs_embeds": (1, 1, d), "attention_mask": (1, pd + 1),
                                              "past_kv": kv_shape}, sess.name)]
        emb = res.step_embeds.view(sess.specs["inputs_embeds"].dtype, (1, 1, d))
        emb[...] = inputs_embeds
        if plan.bucketed:
            # One execution context per bucket: a replayed graph relies on the
            # context's per-shape state, so contexts are never re-shaped.
            key = (profile, pd)
            ctx = res.contexts.get(key)
            if ctx is None:
                ctx = self._bucket_context(profile, kv_shape)
                res.contexts[key] = ctx
            graph = res.graphs.get(key)
            if graph is not None:
                graph.launch(st.cuda.handle)
            else:
                self._enqueue_step(ctx)  # also the warm-up TensorRT wants before a capture
                if not res.graphs_failed:
                    self._capture(key, ctx)
        else:
            sess.select_profile(st, profile)
            self._bind_step(st.context, kv_shape)
            self._enqueue_step(st.context)
        logp = self._download_logp(sess, enqueue=False)
        self._apply(plan.advance())
        return logp

    def close(self) -> None:
        # The per-thread buffers, contexts and graphs stay for the thread's next request.
        self._started = False

    # --- internals ----------------------------------------------------------------------------
    def _bucket_context(self, profile: int, kv_shape: tuple[int, ...]) -> trt.IExecutionContext:
        ctx = self._dec.engine.create_execution_context()
        if ctx is None:
            raise SynthesisError("llm_decode: TensorRT could not create an execution context (out of GPU memory?)")
        if not ctx.set_optimization_profile_async(profile, self._dst.cuda.handle):
            raise SynthesisError(f"llm_decode: cannot select optimization profile {profile}")
        self._bind_step(ctx, kv_shape)
        return ctx

    def _bind_step(self, ctx: trt.IExecutionContext, kv_shape: tuple[int, ...]) -> None:
        res, plan = self._res, self.plan
        ok = (ctx.set_input_shape("inputs_embeds", (1, 1, self._hidden))
              and ctx.set_input_shape("attention_mask", (1, kv_shape[4] + 1))
              and ctx.set_input_shape("past_kv", kv_shape))
        if not ok:
            raise SynthesisError(f"llm_decode: TensorRT rejected the step shapes (past {kv_shape})")
        ctx.set_tensor_address("inputs_embeds", res.step_embeds.device.ptr)
        ctx.set_tensor_address("attention_mask", res.mask.device.ptr if plan.bucketed else res.ones.ptr)
        ctx.set_tensor_address("past_kv", res.kv[plan.past_buf].ptr)
        ctx.set_tensor_address("present_kv", res.kv[plan.present_buf].ptr)
        ctx.set_tensor_address("logp", res.logp.device.ptr)

    def _enqueue_step(self, ctx: trt.IExecutionContext) -> None:
        res, cuda = self._res, self._dst.cuda
        emb = res.step_embeds
        cuda.htod(emb.device.ptr, emb.host[:emb.device.nbytes])
        if not ctx.execute_async_v3(cuda.handle):
            raise SynthesisError("llm_decode: TensorRT execution failed (see the TensorRT log above)")
        cuda.dtoh(res.logp.host[:res.logp.device.nbytes], res.logp.device.ptr)

    def _capture(self, key: tuple[int, int], ctx: trt.IExecutionContext) -> None:
        """Record upload + execute + download for this bucket; the warm-up
        enqueue just ran, so TensorRT's deferred per-shape setup is done."""
        res, cuda = self._res, self._dst.cuda
        cuda.synchronize()
        try:
            cuda.graphs.begin(cuda.handle)
            try:
                self._enqueue_step(ctx)
            except Exception:
                cuda.graphs.abort(cuda.handle)
                raise
            res.graphs[key] = cuda.graphs.end(cuda.handle)
        except Exception as exc:  # a capture failure must not fail the request
            res.graphs_failed = True
            log.warning("llm_decode: CUDA graph capture failed (%s); continuing without graphs", exc)

    def _download_logp(self, sess: TrtSession, enqueue: bool = True) -> np.ndarray:
        res, cuda = self._res, self._dst.cuda
        if enqueue:
            cuda.dtoh(res.logp.host[:res.logp.device.nbytes], res.logp.device.ptr)
        cuda.synchronize()
        return res.logp.view(sess.specs["logp"].dtype, (1, self._vocab)).copy()

    def _apply(self, ops: list[Copy2D | MaskSet | MaskFill]) -> None:
        res, cuda = self._res, self._dst.cuda
        for op in ops:
            if isinstance(op, Copy2D):
                cuda.copy_2d(res.kv[op.dst].ptr + op.dst_offset, op.dst_pitch,
                             res.kv[op.src].ptr + op.src_offset, op.src_pitch, op.width, op.height)
            elif isinstance(op, MaskSet):
                cuda.htod(res.mask.device.ptr + 8 * op.index, res.one)
            else:
                cuda.synchronize()  # the pinned mask may still feed an earlier upload
                host = res.mask.view(np.dtype(np.int64), (1, op.bucket + 1))
                host[...] = bucket_mask(op.valid, op.bucket)
                cuda.htod(res.mask.device.ptr, host)
