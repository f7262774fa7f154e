"""Streaming flow caches in onnxruntime device memory (IOBinding).

Each step cache is one preallocated device buffer [capacity, *row] (an
OrtValue from onnxruntime's allocator for the device). Every estimator call
binds, by pointer and shape, the visible part of it as `att_cache` (no copy)
and the free rows right after the committed ones as `att_cache_new`, so the
graph appends the new frames in place; the conv history stays a device
OrtValue between calls. Only the small per-window inputs go in and dphi_dt
comes out. Growth (doubling) and the bounded-context trim need a
device-to-device copy, which onnxruntime's Python API has no call for: a
one-node Identity graph run with both ends bound by pointer does it
(`DeviceCopier`).

With device "cpu" and the CPU provider the same code runs on host memory:
that is how it is tested without a GPU."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import onnxruntime as ort
from cosyedge_models.backends.cuda import DriverBuffer
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
from cosyedge_models.errors import SynthesisError
from numpy.typing import DTypeLike

log = logging.getLogger(__name__)

# --- a one-node ONNX model, written without the onnx package (a build-only extra) ---
_VARINT, _BYTES = 0, 2
_UINT8 = 2  # TensorProto.UINT8: copies are byte ranges, whatever the cache dtype
_OPSET = 13
_IR_VERSION = 7


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, value: int | bytes | str) -> bytes:
    """One protobuf field: an int as a varint, bytes / str length-delimited."""
    if isinstance(value, int):
        return _varint(number << 3 | _VARINT) + _varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | _BYTES) + _varint(len(data)) + data


def _byte_vector(name: str) -> bytes:
    """ValueInfoProto: a 1-D uint8 tensor of symbolic length."""
    dim = _field(1, _field(2, "n"))  # TensorShapeProto.dim { dim_param: "n" }
    tensor = _field(1, _UINT8) + _field(2, dim)  # TypeProto.Tensor { elem_type, shape }
    return _field(1, name) + _field(2, _field(1, tensor))  # ValueInfoProto { name, type { tensor_type } }


_FLOAT, _INT64, _FLOAT16 = 1, 7, 10  # TensorProto.FLOAT, INT64, FLOAT16
_ATTR_INT, _ATTR_INTS = 2, 7  # AttributeProto.INT, INTS


def _tensor_info(name: str, elem_type: int, dims: list[int | str]) -> bytes:
    """ValueInfoProto of a tensor: an int dim is a dim_value, a str a dim_param."""
    shape = b"".join(_field(1, _field(1, d) if isinstance(d, int) else _field(2, d)) for d in dims)
    return _field(1, name) + _field(2, _field(1, _field(1, elem_type) + _field(2, shape)))


def _node(op_type: str, inputs: list[str], outputs: list[str], name: str, attributes: bytes = b"") -> bytes:
    return (b"".join(_field(1, i) for i in inputs) + b"".join(_field(2, o) for o in outputs) + _field(3, name)
            + _field(4, op_type) + attributes)


def lane_layout_model(perm: list[int], half: bool = False) -> bytes:
    """ModelProto of `dst = Pad(Transpose(src, perm), pads)` over float tensors of rank len(perm)
    (every dim symbolic; `pads` int64 [2 * rank]): a saved prefix's device copy, frame-major,
    into the attention layout of the batched estimator lanes, on the device. `half`: `dst` is
    float16 (a Cast after the Transpose: the fp16 lanes; the prefix's copy stays fp32)."""
    rank = len(perm)
    ints = b"".join(_field(8, p) for p in perm)
    transpose = _node("Transpose", ["src"], ["t"], "to_attention_layout",
                      _field(5, _field(1, "perm") + ints + _field(20, _ATTR_INTS)))
    nodes = _field(1, transpose)
    if half:
        nodes += _field(1, _node("Cast", ["t"], ["h"], "to_lane_precision",
                                 _field(5, _field(1, "to") + _field(3, _FLOAT16) + _field(20, _ATTR_INT))))
    pad = _node("Pad", ["h" if half else "t", "pads"], ["dst"], "to_buffer_frames")
    graph = (nodes + _field(1, pad) + _field(2, "lane_layout")
             + _field(11, _tensor_info("src", _FLOAT, [f"s{i}" for i in range(rank)]))
             + _field(11, _tensor_info("pads", _INT64, [2 * rank]))
             + _field(12, _tensor_info("dst", _FLOAT16 if half else _FLOAT, [f"d{i}" for i in range(rank)])))
    opset = _field(1, "") + _field(2, _OPSET)
    return _field(1, _IR_VERSION) + _field(2, "cosyedge") + _field(7, graph) + _field(8, opset)


def identity_model(copies: int = 1) -> bytes:
    """ModelProto of `dst = Identity(src)` over uint8 vectors; with copies > 1, `dst<i> =
    Identity(src<i>)` for i < copies (independent copies, one session run)."""
    names = [("src", "dst")] if copies == 1 else [(f"src{i}", f"dst{i}") for i in range(copies)]
    graph = b"".join(_field(1, _field(1, s) + _field(2, d) + _field(3, f"copy_{d}") + _field(4, "Identity"))
                     for s, d in names)
    graph += _field(2, "device_copy")
    graph += b"".join(_field(11, _byte_vector(s)) for s, _ in names)
    graph += b"".join(_field(12, _byte_vector(d)) for _, d in names)
    opset = _field(1, "") + _field(2, _OPSET)
    return _field(1, _IR_VERSION) + _field(2, "cosyedge") + _field(7, graph) + _field(8, opset)


def helper_session(model: bytes, device: tuple[str, int]) -> ort.InferenceSession:
    """A session of one of these hand-written helper graphs on `device` ("cuda", with the CPU
    beside it, or "cpu"), one thread, unoptimized: nothing to optimize, and an optimizer must not
    drop their nodes."""
    kind, device_id = device
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    providers: list[str | tuple[str, dict[str, str]]] = ["CPUExecutionProvider"]
    if kind == "cuda":
        providers.insert(0, ("CUDAExecutionProvider", {"device_id": str(device_id)}))
    return ort.InferenceSession(model, sess_options=opts, providers=providers)


def device_zeros(shape: Sequence[int], dtype: DTypeLike, device: tuple[str, int]) -> ort.OrtValue:
    """A zeroed tensor on `device` (the fixed-shape runtimes' bound inputs, outputs and buffers)."""
    return ort.OrtValue.ortvalue_from_numpy(np.zeros([int(d) for d in shape], dtype), *device)


class FixedBuffer:
    """A zeroed cache buffer of a fixed-shape runtime, bound into onnxruntime by pointer (`ptr`): host
    memory on "cpu"; on "cuda" exactly its bytes from the driver (cuda.DriverBuffer), not an OrtValue,
    whose allocator rounds a large buffer up to a power of two (the batched lanes' 42 GB took the rest
    of an H100). close() frees it; the runtime that made it closes it."""

    def __init__(self, shape: Sequence[int], dtype: DTypeLike, device: tuple[str, int]) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        kind, dev = device
        self._host: np.ndarray | None = None
        self._device: DriverBuffer | None = None
        if kind == "cuda":
            self._device = DriverBuffer(self.nbytes, dev)
            self.ptr = self._device.ptr
        else:
            self._host = np.zeros(self.shape, self.dtype)
            self.ptr = int(self._host.ctypes.data)

    def numpy(self) -> np.ndarray:
        """A host copy of the whole buffer."""
        if self._host is not None:
            return self._host.copy()
        if self._device is None:
            raise SynthesisError("the buffer was closed")
        return self._device.read(0, self.nbytes).view(self.dtype).reshape(self.shape)

    def close(self) -> None:
        if self._device is not None:
            self._device.close()
            self._device = None
        self._host = None


# The copies a copy_many run may hold. A session a count (as before) made one on the GPU for each new
# count while serving, each with its own cuBLAS handle and workspace (~155 MB), so the memory grew after
# the load had measured it (H100, twenty-second run: the first requests ran out of memory making one).
COPY_RUN_SIZES = (64, 32, 16, 8, 4, 2)


def copy_runs(count: int) -> list[int]:
    """`count` copies as runs of COPY_RUN_SIZES (largest first) and a last single copy where one is left."""
    runs = []
    for size in COPY_RUN_SIZES:
        while count >= size:
            runs.append(size)
            count -= size
    return runs + [1] * count


class DeviceCopier:
    """Byte copies between device addresses through the Identity graph (its
    kernel copies input to output with the device's own memcpy). One per
    backend and device; onnxruntime sessions are safe to run from several threads.
    `copy_many` runs a batch of copies in a few session runs (graphs of COPY_RUN_SIZES
    Identity nodes, each made once): a lane's 2 L block copies cost a run or three instead
    of 2 L."""

    def __init__(self, device_type: str, device_id: int = 0) -> None:
        self.device = (device_type, device_id)
        self._sess = helper_session(identity_model(), self.device)
        self._many: dict[int, ort.InferenceSession] = {}  # copies per run -> its graph's session
        self._lock = threading.Lock()

    def copy(self, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        """Copy `nbytes` from src to dst (the ranges must not overlap)."""
        if nbytes <= 0:
            return
        kind, dev = self.device
        binding = self._sess.io_binding()
        binding.bind_input("src", kind, dev, np.uint8, [nbytes], src_ptr)
        binding.bind_output("dst", kind, dev, np.uint8, [nbytes], dst_ptr)
        self._run(self._sess, binding, f"device copy of {nbytes} bytes")

    def copy_many(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Every (dst_ptr, src_ptr, nbytes) copy, in runs of COPY_RUN_SIZES (no range may overlap another)."""
        copies = [c for c in copies if c[2] > 0]
        start = 0
        for size in copy_runs(len(copies)):
            if size == 1:
                self.copy(*copies[start])
            else:
                self._copy_run(copies[start:start + size])
            start += size

    def _copy_run(self, copies: Sequence[tuple[int, int, int]]) -> None:
        with self._lock:
            sess = self._many.get(len(copies))
            if sess is None:
                sess = self._many[len(copies)] = helper_session(identity_model(len(copies)), self.device)
        kind, dev = self.device
        binding = sess.io_binding()
        for i, (dst, src, nbytes) in enumerate(copies):
            binding.bind_input(f"src{i}", kind, dev, np.uint8, [nbytes], src)
            binding.bind_output(f"dst{i}", kind, dev, np.uint8, [nbytes], dst)
        self._run(sess, binding, f"{len(copies)} device copies of {sum(c[2] for c in copies)} bytes")

    @staticmethod
    def _run(sess: ort.InferenceSession, binding: ort.IOBinding, what: str) -> None:
        try:
            sess.run_with_iobinding(binding)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise SynthesisError(f"{what} failed: {exc}") from exc


class BoundRunner(Protocol):
    """What BoundStepCache needs of a session (OrtSession has it)."""

    def io_binding(self) -> ort.IOBinding: ...

    def run_bound(self, binding: ort.IOBinding) -> None: ...


class BoundStepCache:
    """StepCache in device memory, bound to the estimator by pointer."""

    def __init__(self, session: BoundRunner, spec: StepCacheSpec, copier: DeviceCopier) -> None:
        self.spec = spec
        self._session = session
        self._copier = copier
        self._device = copier.device
        kind, dev = self._device
        self.rows: DeviceRows[ort.OrtValue] = DeviceRows(
            spec, lambda frames: ort.OrtValue.ortvalue_from_shape_and_type([frames, *spec.row], spec.dtype.type,
                                                                           kind, dev),
            lambda buf: int(buf.data_ptr()), copier.copy,
            lambda buf: None)  # dropping the last reference gives the memory back to onnxruntime's arena
        self._conv: ort.OrtValue | None = ort.OrtValue.ortvalue_from_numpy(
            np.zeros(spec.conv, dtype=np.float32), kind, dev)

    @property
    def length(self) -> int:
        return self.rows.length

    @property
    def capacity(self) -> int:
        return self.rows.capacity

    @property
    def growths(self) -> int:
        return self.rows.growths

    def adopt(self, src_ptr: int, frames: int, conv: ort.OrtValue) -> None:
        """Start from `frames` committed rows at src_ptr and a conv history
        (device copies: a fixed-shape cache moving here, ort_static_flow.py)."""
        self.rows.copy_in(src_ptr, frames)
        assert self._conv is not None
        self._copier.copy(int(self._conv.data_ptr()), int(conv.data_ptr()), self.spec.conv_bytes)

    def run(self, feeds: Mapping[str, np.ndarray], commit: int) -> np.ndarray:
        rows = self.rows
        if rows.buffer is None or self._conv is None:
            raise RuntimeError("flow cache used after close()")
        rows.reserve(rows.length + commit)  # before binding: growth moves the buffer
        kind, dev = self._device
        dtype = self.spec.dtype.type
        first = rows.first()
        binding = self._session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        binding.bind_input(ATT_CACHE, kind, dev, dtype, [rows.length - first, *self.spec.row], rows.ptr(first))
        binding.bind_ortvalue_input(CONV_CACHE, self._conv)
        binding.bind_output(DPHI_DT, "cpu")
        if commit:
            # Zero-copy append: the graph writes the new rows after the committed ones.
            binding.bind_output(ATT_CACHE_NEW, kind, dev, dtype, [commit, *self.spec.row], rows.ptr(rows.length))
            binding.bind_output(CONV_CACHE_NEW, kind, dev)
        self._session.run_bound(binding)
        outputs = binding.get_outputs()
        if commit:
            rows.length += commit
            self._conv = outputs[2]
        return np.asarray(outputs[0].numpy())

    def trim(self) -> None:
        self.rows.trim()

    def preload(self, rows: PrefixRows, conv: np.ndarray) -> None:
        """The saved rows copied into the device buffer from their copy on this
        device (uploaded once per voice and device), the conv history uploaded."""
        if self.rows.length:
            raise RuntimeError("preload() on a cache that holds frames")
        kind, dev = self._device
        self.rows.reserve(rows.frames)
        copy_prefix(self._copier, self.rows.ptr(0), rows, self.spec.dtype)
        self.rows.length = rows.frames
        self._conv = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(conv, dtype=np.float32), kind, dev)

    def nbytes(self) -> int:
        if self.rows.buffer is None:
            return 0
        return self.rows.nbytes() + self.spec.conv_bytes

    def close(self) -> None:
        # Drops the only references: the memory goes back to onnxruntime's
        # allocator for the device (its arena reuses it for the next request).
        self.rows.close()
        self._conv = None


class BoundCacheFactory:
    """Backend.flow_cache over IOBinding for one device; the copier is made
    on first use and shared by the requests (thread-safe)."""

    def __init__(self, device_type: str, device_id: int = 0) -> None:
        self.device = (device_type, device_id)
        self._copier: DeviceCopier | None = None
        self._lock = threading.Lock()

    def copier(self) -> DeviceCopier:
        with self._lock:
            if self._copier is None:
                kind, dev = self.device
                # onnxruntime's Python binding creates its allocator for a device on
                # first use without a lock; do that here, before request threads race.
                ort.OrtValue.ortvalue_from_shape_and_type([1], np.uint8, kind, dev)
                self._copier = DeviceCopier(kind, dev)
            return self._copier

    def __call__(self, session: BoundRunner, spec: StepCacheSpec) -> BoundStepCache:
        return BoundStepCache(session, spec, self.copier())


def copy_prefix(copier: DeviceCopier, dst_ptr: int, rows: PrefixRows, dtype: DTypeLike) -> None:
    """The voice's saved rows copied to `dst_ptr` on the copier's device, as `dtype`, from
    their copy there (uploaded once per voice and device; an OrtValue, freed with its last
    reference when the voice is retired)."""
    kind, dev = copier.device

    def upload(host: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(host, dtype=dtype), kind, dev)

    with rows.lease(copier.device, upload) as src:
        copier.copy(dst_ptr, int(src.data_ptr()), rows.frames * int(np.prod(rows.host.shape[1:]))
                    * np.dtype(dtype).itemsize)
