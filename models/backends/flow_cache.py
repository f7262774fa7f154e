"""The streaming flow estimator's caches of one request and one Euler step:
the K/V of the committed frames (time-major, growing) and the causal
convolutions' history. Where they live is the backend's choice
(`Backend.flow_cache`): host arrays here (`HostStepCache`, right for the CPU
and for backends that take host inputs), device memory bound by pointer
through onnxruntime IOBinding in models/backends/ort_cache.py."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    from cosyedge_models.backends.base import Session

log = logging.getLogger(__name__)

# The estimator graph's cache I/O (edge_build/export/flow_estimator.py).
ATT_CACHE, CONV_CACHE = "att_cache", "conv_cache"
ATT_CACHE_NEW, CONV_CACHE_NEW, DPHI_DT = "att_cache_new", "conv_cache_new", "dphi_dt"


@dataclass(frozen=True)
class StepCacheSpec:
    """Shapes of one step's caches: `row` is one frame of K/V (blocks, K|V,
    CFG rows, heads, head_dim) in `dtype` (fp16 for fp16 bundles), `conv` the
    fp32 conv history. `visible` -1: every committed frame is attended to;
    N >= 0: only the last N (bounded left context)."""

    row: tuple[int, ...]
    conv: tuple[int, ...]
    dtype: np.dtype[Any]
    visible: int = -1
    initial_frames: int = 0  # capacity reserved up front (device buffers); grows by doubling
    # the Euler step the cache serves (-1: unknown): batched flow graphs group a step's caches
    # (models/batching/flow_batcher.py); other stores ignore it
    euler_step: int = -1

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row)) * self.dtype.itemsize

    @property
    def conv_bytes(self) -> int:
        return int(np.prod(self.conv)) * 4


class StepCache(Protocol):
    """One Euler step's estimator caches for one request."""

    spec: StepCacheSpec

    @property
    def length(self) -> int:
        """Committed frames held (after a trim: the kept ones)."""
        ...

    def run(self, feeds: Mapping[str, np.ndarray], commit: int) -> np.ndarray:
        """One estimator call over `feeds` (every input but the caches) with
        these caches as att_cache / conv_cache; returns dphi_dt as a host array.
        commit > 0: the call's first `commit` frames are appended
        (att_cache_new) and the conv history becomes conv_cache_new."""
        ...

    def trim(self) -> None:
        """Bounded left context: drop frames no longer visible (amortized)."""
        ...

    def preload(self, rows: PrefixRows, conv: np.ndarray) -> None:
        """Start from saved state instead of nothing (a voice's prompt chunks,
        models/synthesis/voice_cache.py): its K/V rows and the conv history; before the
        first run. The saved arrays are read, never written."""
        ...

    def nbytes(self) -> int:
        """Memory held (the K/V buffer's capacity and the conv history)."""
        ...

    def close(self) -> None:
        """Release the buffers; the cache is unusable afterwards."""
        ...


def read_only(a: np.ndarray) -> np.ndarray:
    """`a` as an array of its own that cannot be written (a view's owner might be): what same_values trusts."""
    owned = a if a.base is None else a.copy()
    owned.flags.writeable = False
    return owned


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether `a` and `b` view the same bytes of one read-only array alike (`read_only`): their values are
    then equal, known without reading them (no numpy call: none that gives the GIL up and waits to get it
    back among busy threads)."""
    owner = a if a.base is None else a.base
    return ((a is b or (a.base is not None and a.base is b.base)) and isinstance(owner, np.ndarray)
            and not owner.flags.writeable and a.__array_interface__ == b.__array_interface__)


class PrefixRows:
    """Saved K/V rows [frames, ...] (a voice's prompt chunks) in host memory,
    plus one copy per device, made by the first request there (`lease`), so
    that later requests seed their device caches with a device-to-device copy
    instead of a host-to-device one. The voice cache `retire()`s them when it
    drops the voice: the device copies are freed then, or when the last
    request still copying from them ends its lease."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = host
        # device -> (copy, how to free it: None when dropping the reference frees it)
        self._device: dict[tuple[str, int], tuple[Any, Callable[[Any], None] | None]] = {}
        self._leases = 0
        self._retired = False
        self._lock = threading.Lock()

    @property
    def frames(self) -> int:
        return int(self.host.shape[0])

    @contextlib.contextmanager
    def lease(self, device: tuple[str, int], upload: Callable[[np.ndarray], Any],
              release: Callable[[Any], None] | None = None) -> Iterator[Any]:
        """The copy on `device` (uploaded with `upload(host)` on first use, freed with
        `release(copy)`), valid until the block ends."""
        with self._lock:
            if device not in self._device:
                self._device[device] = (upload(self.host), release)
            copy = self._device[device][0]
            self._leases += 1
        try:
            yield copy
        finally:
            with self._lock:
                self._leases -= 1
                idle = self._take_idle()
            _free(idle)

    def retire(self) -> None:
        """The voice left the cache: free the device copies once no request reads them."""
        with self._lock:
            self._retired = True
            idle = self._take_idle()
        _free(idle)

    def _take_idle(self) -> list[tuple[Any, Callable[[Any], None] | None]]:
        if not self._retired or self._leases:
            return []
        copies, self._device = list(self._device.values()), {}
        return copies

    def device_nbytes(self) -> int:
        with self._lock:
            return self.host.nbytes * len(self._device)


def _free(copies: list[tuple[Any, Callable[[Any], None] | None]]) -> None:
    for copy, release in copies:
        if release is not None:
            release(copy)


def trim_due(length: int, keep: int, capacity: int) -> bool:
    """Bounded left context: move the last `keep` frames to the front once the
    dropped ones fill half the buffer (amortized, like the growth; length >
    2 * keep, so the moved rows never overlap their new place)."""
    return length > max(2 * keep, 1) and length - keep >= capacity // 2


BufT = TypeVar("BufT")


class DeviceRows(Generic[BufT]):
    """The committed K/V rows of a device step cache (onnxruntime's, ort_cache.py, and
    TensorRT's, tensorrt/flow_cache.py): one device buffer [capacity, *row] that grows
    by doubling and, with a bounded left context, trims (trim_due), both by
    device-to-device copies. The runtime's device calls are passed in: `alloc(frames)`
    a buffer, `address(buf)` its device address, `copy(dst, src, nbytes)` (done when
    it returns), `free(buf)`."""

    def __init__(self, spec: StepCacheSpec, alloc: Callable[[int], BufT], address: Callable[[BufT], int],
                 copy: Callable[[int, int, int], None], free: Callable[[BufT], None]) -> None:
        self.spec = spec
        self._alloc, self._address, self._copy, self._release = alloc, address, copy, free
        self.length = 0  # committed rows
        self.capacity = 0
        self.growths = 0  # reallocations that moved committed rows (tests, logs)
        self.buffer: BufT | None = None
        self.reserve(max(spec.initial_frames, 1))

    def ptr(self, frame: int) -> int:
        if self.buffer is None:
            raise RuntimeError("flow cache used after close()")
        return self._address(self.buffer) + frame * self.spec.row_bytes

    def first(self) -> int:
        """The first row a call attends to (all, or the last `visible`)."""
        return 0 if self.spec.visible < 0 else max(self.length - self.spec.visible, 0)

    def reserve(self, frames: int) -> None:
        """Room for `frames` rows: a buffer of double the capacity (or more), the committed rows copied."""
        if frames <= self.capacity:
            return
        capacity = max(2 * self.capacity, frames)
        grown = self._alloc(capacity)
        if self.buffer is not None:
            if self.length:
                self._copy(self._address(grown), self.ptr(0), self.length * self.spec.row_bytes)
                self.growths += 1
                log.debug("flow cache: %d -> %d frames (%.1f MiB), %d rows copied", self.capacity, capacity,
                          capacity * self.spec.row_bytes / (1 << 20), self.length)
            self._release(self.buffer)
        self.buffer, self.capacity = grown, capacity

    def copy_in(self, src_ptr: int, frames: int) -> None:
        """Start from `frames` rows at `src_ptr` on the same device."""
        if self.length:
            raise RuntimeError("the flow cache already holds frames")
        self.reserve(max(frames, 1))
        if frames:
            self._copy(self.ptr(0), src_ptr, frames * self.spec.row_bytes)
        self.length = frames

    def trim(self) -> None:
        """Bounded left context: the last `visible` rows to the front once trim_due says so."""
        keep = self.spec.visible
        if keep < 0 or self.buffer is None:
            return
        if trim_due(self.length, keep, self.capacity):
            self._copy(self.ptr(0), self.ptr(self.length - keep), keep * self.spec.row_bytes)
            self.length = keep

    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.capacity * self.spec.row_bytes

    def close(self) -> None:
        if self.buffer is not None:
            self._release(self.buffer)
            self.buffer = None
        self.capacity = self.length = 0


class HostKvBuffer:
    """A growing time-major K/V buffer [frames, ...] in host memory: a prefix
    (or, with a bounded left context, a suffix) of it is passed to the graph
    without a copy. Rows appended past the capacity wait until the next read,
    so the growth copy happens at the next call rather than on the way to
    this call's output (a stream's first chunk, where the rows are a voice's
    shared prompt cache, returns without copying them)."""

    def __init__(self, tail: tuple[int, ...], visible: int = -1, dtype: np.dtype[Any] | None = None) -> None:
        self.dtype = np.dtype(np.float32) if dtype is None else dtype
        self._kv = np.zeros((0, *tail), dtype=self.dtype)
        self._held = 0  # rows in _kv
        self._pending: list[np.ndarray] = []  # appended rows not yet in _kv
        self.length = 0  # committed rows: held + pending
        self.visible = visible  # -1: all committed frames; else only the last `visible`

    @property
    def kv(self) -> np.ndarray:
        self._flush()
        first = 0 if self.visible < 0 else max(self.length - self.visible, 0)
        return self._kv[first: self.length]

    def _flush(self) -> None:
        if not self._pending:
            return
        if self.length > self._kv.shape[0]:
            grown = np.empty((max(2 * self._kv.shape[0], self.length), *self._kv.shape[1:]), dtype=self.dtype)
            grown[: self._held] = self._kv[: self._held]
            self._kv = grown
        for rows in self._pending:
            self._kv[self._held: self._held + rows.shape[0]] = rows
            self._held += rows.shape[0]
        self._pending.clear()

    def trim(self, keep: int) -> None:
        """Drop all but the last `keep` frames once they take more than half the
        buffer (bounded left context): amortized, like the growth."""
        self._flush()
        if trim_due(self.length, keep, self._kv.shape[0]):
            self._kv[:keep] = self._kv[self.length - keep: self.length].copy()
            self.length = self._held = keep

    def share(self, kv: np.ndarray) -> None:
        """Start from `kv` without a copy: it is held read-only and exactly
        full, so the first append moves it into a buffer of this one's own."""
        if self.length:
            raise RuntimeError("share() on a buffer that holds frames")
        view = kv.view()
        view.flags.writeable = False
        self._kv, self._held, self.length = view, view.shape[0], view.shape[0]

    def append(self, new: np.ndarray) -> None:
        n = new.shape[0]
        if not self._pending and self.length + n <= self._kv.shape[0] and self._kv.flags.writeable:
            self._kv[self.length: self.length + n] = new
            self._held += n
        else:
            self._pending.append(new)
        self.length += n

    def nbytes(self) -> int:
        return self._kv.nbytes + sum(p.nbytes for p in self._pending)

    def clear(self) -> None:
        self._kv = self._kv[:0]
        self._pending.clear()
        self.length = self._held = 0


class HostStepCache:
    """StepCache in host arrays: every call passes the visible K/V as a
    numpy view (the runtime copies it to its device, if it has one)."""

    def __init__(self, estimator: Session, spec: StepCacheSpec) -> None:
        self.spec = spec
        self._estimator = estimator
        self._buf = HostKvBuffer(spec.row, spec.visible, spec.dtype)
        self.conv = np.zeros(spec.conv, dtype=np.float32)
        self._closed = False

    @property
    def length(self) -> int:
        return self._buf.length

    @property
    def kv(self) -> np.ndarray:
        """The visible K/V (a view)."""
        return self._buf.kv

    def run(self, feeds: Mapping[str, np.ndarray], commit: int) -> np.ndarray:
        if self._closed:
            raise RuntimeError("flow cache used after close()")
        out = self._estimator.run({**feeds, ATT_CACHE: self._buf.kv, CONV_CACHE: self.conv})
        if commit:
            self._buf.append(out[ATT_CACHE_NEW])
            self.conv = out[CONV_CACHE_NEW]
        return out[DPHI_DT]

    def trim(self) -> None:
        if self.spec.visible >= 0:
            self._buf.trim(self.spec.visible)

    def preload(self, rows: PrefixRows, conv: np.ndarray) -> None:
        self._buf.share(rows.host)  # shared with the voice cache until the first commit
        self.conv = conv

    def nbytes(self) -> int:
        return self._buf.nbytes() + self.conv.nbytes

    def close(self) -> None:
        self._buf.clear()
        self.conv = self.conv[:0]
        self._closed = True


def host_flow_cache(estimator: Session, spec: StepCacheSpec) -> StepCache:
    """Backend.flow_cache for backends that keep the caches on the host."""
    return HostStepCache(estimator, spec)
