"""Streaming flow caches in device memory for the TensorRT backend (the
`trt` counterpart of models/backends/ort_cache.py).

One step cache is a device buffer [capacity, *row] for the committed K/V
(time-major) and two conv-history buffers used in turn. Each estimator call
binds, by address, the visible rows as `att_cache` and the free rows right
after the committed ones as `att_cache_new`, so the engine appends in place;
`conv_cache_new` goes to the spare conv buffer, which becomes the history.
Only the window's small inputs cross from the host and dphi_dt back. Growth
(doubling) and the bounded-context trim are device-to-device copies on the
calling thread's stream. Written against the TensorRT 10 Python API through
models/backends/tensorrt/backend.py's TrtSession; runs only where TensorRT and a GPU do
(`pytest -m gpu`), type-checked everywhere."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from cosyedge_models.backends.cuda import DeviceBuffer
from cosyedge_models.backends.flow_cache import (
    ATT_CACHE,
    ATT_CACHE_NEW,
    CONV_CACHE,
    CONV_CACHE_NEW,
    DPHI_DT,
    PrefixRows,
    StepCacheSpec,
    trim_due,
)
from cosyedge_models.backends.profiles import choose_profile
from cosyedge_models.backends.tensorrt.session import TrtSession
from cosyedge_models.errors import SynthesisError


class TrtStepCache:
    """StepCache whose K/V rows and conv history never leave the GPU."""

    def __init__(self, session: TrtSession, spec: StepCacheSpec) -> None:
        self.spec = spec
        self._session = session
        self.length = 0
        self.growths = 0
        self._capacity = 0
        self._kv: DeviceBuffer | None = None
        self._reserve(max(spec.initial_frames, 1))
        self._conv = [DeviceBuffer(spec.conv_bytes), DeviceBuffer(spec.conv_bytes)]
        st = session.state()
        for buf in self._conv:  # zeros: upstream's causal padding, an empty history
            st.cuda.zero(buf.ptr, spec.conv_bytes)
        self._cur = 0

    def _ptr(self, frame: int) -> int:
        assert self._kv is not None
        return self._kv.ptr + frame * self.spec.row_bytes

    def _reserve(self, frames: int) -> None:
        if frames <= self._capacity:
            return
        capacity = max(2 * self._capacity, frames)
        grown = DeviceBuffer(capacity * self.spec.row_bytes)
        if self._kv is not None:
            if self.length:
                st = self._session.state()
                st.cuda.dtod(grown.ptr, self._ptr(0), self.length * self.spec.row_bytes)
                st.cuda.synchronize()
                self.growths += 1
            self._kv.close()
        self._kv, self._capacity = grown, capacity

    def preload(self, rows: PrefixRows, conv: np.ndarray) -> None:
        """A saved voice's prefix (its prompt chunks) uploaded before the first run."""
        if self.length:
            raise RuntimeError("preload() on a cache that holds frames")
        st = self._session.state()
        self._reserve(rows.frames)
        st.cuda.htod(self._ptr(0), np.ascontiguousarray(rows.host, dtype=self.spec.dtype))
        st.cuda.htod(self._conv[self._cur].ptr, np.ascontiguousarray(conv, dtype=np.float32))
        st.cuda.synchronize()
        self.length = rows.frames

    def adopt(self, src_ptr: int, frames: int, conv_ptr: int) -> None:
        """Start from `frames` rows and a conv history already on this device (a fixed-shape
        slot's, models/backends/tensorrt/static_flow.py), by device-to-device copies."""
        if self.length:
            raise RuntimeError("adopt() on a cache that holds frames")
        st = self._session.state()
        self._reserve(max(frames, 1))
        if frames:
            st.cuda.dtod(self._ptr(0), src_ptr, frames * self.spec.row_bytes)
        st.cuda.dtod(self._conv[self._cur].ptr, conv_ptr, self.spec.conv_bytes)
        st.cuda.synchronize()
        self.length = frames

    def run(self, feeds: Mapping[str, np.ndarray], commit: int) -> np.ndarray:
        if self._kv is None:
            raise RuntimeError("flow cache used after close()")
        self._reserve(self.length + commit)
        sess = self._session
        st = sess.state()
        first = 0 if self.spec.visible < 0 else max(self.length - self.spec.visible, 0)
        visible = self.length - first
        row = tuple(self.spec.row)
        shapes = {n: tuple(np.shape(v)) for n, v in feeds.items() if not sess.specs[n].host_side}
        shapes[ATT_CACHE] = (visible, *row)
        shapes[CONV_CACHE] = tuple(self.spec.conv)
        bufs = sess.activate(st, choose_profile(sess.profiles, shapes, sess.name))
        for name, value in feeds.items():
            sess.bind_input(st, bufs, name, value)
        ctx = st.context
        conv_in, conv_out = self._conv[self._cur], self._conv[1 - self._cur]
        if not (ctx.set_input_shape(ATT_CACHE, (visible, *row)) and ctx.set_input_shape(CONV_CACHE, self.spec.conv)):
            raise SynthesisError(f"{sess.name}: TensorRT rejected the cache shapes ({visible} frames)")
        ctx.set_tensor_address(ATT_CACHE, self._ptr(first))
        ctx.set_tensor_address(CONV_CACHE, conv_in.ptr)
        out_shapes = sess.bind_outputs(st, bufs)  # dphi_dt to its own buffer; the caches below, in place
        if out_shapes[ATT_CACHE_NEW][0] != commit:
            raise SynthesisError(
                f"{sess.name}: att_cache_new has {out_shapes[ATT_CACHE_NEW][0]} rows, expected {commit}")
        ctx.set_tensor_address(ATT_CACHE_NEW, self._ptr(self.length))
        ctx.set_tensor_address(CONV_CACHE_NEW, conv_out.ptr)
        sess.execute(st)
        dphi = sess.host_view(bufs[DPHI_DT], DPHI_DT, out_shapes[DPHI_DT])
        st.cuda.dtoh(dphi, bufs[DPHI_DT].device.ptr)
        st.cuda.synchronize()
        if commit:
            self.length += commit
            self._cur = 1 - self._cur
        return dphi.copy()

    def trim(self) -> None:
        keep = self.spec.visible
        if keep < 0 or self._kv is None:
            return
        if trim_due(self.length, keep, self._capacity):
            st = self._session.state()
            st.cuda.dtod(self._ptr(0), self._ptr(self.length - keep), keep * self.spec.row_bytes)
            st.cuda.synchronize()
            self.length = keep

    def nbytes(self) -> int:
        if self._kv is None:
            return 0
        return self._capacity * self.spec.row_bytes + 2 * self.spec.conv_bytes

    def close(self) -> None:
        if self._kv is not None:
            self._kv.close()
            self._kv = None
        for buf in self._conv:
            buf.close()
        self._capacity = self.length = 0
