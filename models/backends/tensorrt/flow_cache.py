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
    DeviceRows,
    PrefixRows,
    StepCacheSpec,
)
from cosyedge_models.backends.profiles import choose_profile
from cosyedge_models.backends.tensorrt.session import TrtSession
from cosyedge_models.errors import SynthesisError


class TrtStepCache:
    """StepCache whose K/V rows and conv history never leave the GPU."""

    def __init__(self, session: TrtSession, spec: StepCacheSpec) -> None:
        self.spec = spec
        self._session = session
        self.rows: DeviceRows[DeviceBuffer] = DeviceRows(
            spec, lambda frames: DeviceBuffer(frames * spec.row_bytes), lambda buf: buf.ptr, self._copy,
            DeviceBuffer.close)
        self._conv = [DeviceBuffer(spec.conv_bytes), DeviceBuffer(spec.conv_bytes)]
        st = session.state()
        for buf in self._conv:  # zeros: upstream's causal padding, an empty history
            st.cuda.zero(buf.ptr, spec.conv_bytes)
        self._cur = 0

    @property
    def length(self) -> int:
        return self.rows.length

    @property
    def growths(self) -> int:
        return self.rows.growths

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        """A device copy on the calling thread's stream, done when it returns (a growth frees its source next)."""
        st = self._session.state()
        st.cuda.dtod(dst, src, nbytes)
        st.cuda.synchronize()

    def preload(self, rows: PrefixRows, conv: np.ndarray) -> None:
        """A saved voice's prefix (its prompt chunks) uploaded before the first run."""
        if self.rows.length:
            raise RuntimeError("preload() on a cache that holds frames")
        st = self._session.state()
        self.rows.reserve(rows.frames)
        st.cuda.htod(self.rows.ptr(0), np.ascontiguousarray(rows.host, dtype=self.spec.dtype))
        st.cuda.htod(self._conv[self._cur].ptr, np.ascontiguousarray(conv, dtype=np.float32))
        st.cuda.synchronize()
        self.rows.length = rows.frames

    def adopt(self, src_ptr: int, frames: int, conv_ptr: int) -> None:
        """Start from `frames` rows and a conv history already on this device (a fixed-shape
        slot's, models/backends/tensorrt/static_flow.py), by device-to-device copies."""
        self.rows.copy_in(src_ptr, frames)
        self._copy(self._conv[self._cur].ptr, conv_ptr, self.spec.conv_bytes)

    def run(self, feeds: Mapping[str, np.ndarray], commit: int) -> np.ndarray:
        rows = self.rows
        if rows.buffer is None:
            raise RuntimeError("flow cache used after close()")
        rows.reserve(rows.length + commit)
        sess = self._session
        st = sess.state()
        first = rows.first()
        visible = rows.length - first
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
        ctx.set_tensor_address(ATT_CACHE, rows.ptr(first))
        ctx.set_tensor_address(CONV_CACHE, conv_in.ptr)
        out_shapes = sess.bind_outputs(st, bufs)  # dphi_dt to its own buffer; the caches below, in place
        if out_shapes[ATT_CACHE_NEW][0] != commit:
            raise SynthesisError(
                f"{sess.name}: att_cache_new has {out_shapes[ATT_CACHE_NEW][0]} rows, expected {commit}")
        ctx.set_tensor_address(ATT_CACHE_NEW, rows.ptr(rows.length))
        ctx.set_tensor_address(CONV_CACHE_NEW, conv_out.ptr)
        sess.execute(st)
        dphi = sess.host_view(bufs[DPHI_DT], DPHI_DT, out_shapes[DPHI_DT])
        st.cuda.dtoh(dphi, bufs[DPHI_DT].device.ptr)
        st.cuda.synchronize()
        if commit:
            rows.length += commit
            self._cur = 1 - self._cur
        return dphi.copy()

    def trim(self) -> None:
        self.rows.trim()

    def nbytes(self) -> int:
        if self.rows.buffer is None:
            return 0
        return self.rows.nbytes() + 2 * self.spec.conv_bytes

    def close(self) -> None:
        self.rows.close()
        for buf in self._conv:
            buf.close()
