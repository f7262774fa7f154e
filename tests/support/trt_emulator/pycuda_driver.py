"""`pycuda.driver` on the emulated GPU: the calls cosyedge_models.backends.cuda uses.

Rules (pycuda's documentation https://documen.tician.de/pycuda/driver.html and its C++ wrapper
src/cpp/cuda.hpp, which the documentation defers to for object lifetimes):
- `init()` first: every other call fails before it (cuInit, "Initialization").
- objects that belong to a context (allocations, page-locked memory, streams) need a context on
  pycuda's own per-thread stack when they are made ("explicit_context_dependent ... no currently
  active context?" in cuda.hpp);
- their free (explicit or when garbage-collected) activates that context: from a thread where it is
  not on top of pycuda's stack and which did not create the context object, pycuda cannot activate it
  ("cannot activate out-of-thread context") and skips the free SILENTLY
  (CUDAPP_CATCH_CLEANUP_ON_DEAD_CONTEXT): the memory leaks. The emulator keeps it allocated and
  lists it in `Machine.skipped_frees`;
- a thread that ends with a context still on pycuda's stack aborts the process (context_stack's
  destructor): recorded in `Machine.errors`;
- copies take integer device addresses; an address outside every allocation fails.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

from tests.support.trt_emulator.machine import ILLEGAL_ADDRESS, CudaError, Machine, Op, defer, finalizer


class Error(Exception):
    pass


class LogicError(Error):
    pass


class LaunchError(Error):
    pass


class CudaRuntimeError(Error):
    pass


class CudaMemoryError(Error):
    pass


def _raise(exc: CudaError) -> Exception:
    if exc.code == 2:
        return CudaMemoryError(str(exc))
    if exc.code == ILLEGAL_ADDRESS:
        return LaunchError(str(exc))
    return LogicError(str(exc))


class _PycudaStack(list):  # type: ignore[type-arg]
    """pycuda's per-thread context stack (context objects, top last)."""


class _Sentinel:
    pass


def make_driver(machine: Machine) -> types.ModuleType:
    """A fresh `pycuda.driver` module bound to `machine`."""
    mod = types.ModuleType("pycuda.driver")
    local = threading.local()

    def stack() -> _PycudaStack:
        st: _PycudaStack | None = getattr(local, "stack", None)
        if st is None:
            st = _PycudaStack()
            local.stack = st
            # pycuda's context_stack destructor aborts when a thread ends with a context still pushed:
            # the sentinel goes with the thread's locals
            local.sentinel = _Sentinel()
            finalizer(local.sentinel, _thread_end, machine, st, threading.current_thread().name)
        return st

    def current() -> Context | None:
        st = stack()
        return st[-1] if st else None

    def need_init(what: str) -> None:
        if not machine.initialized:
            raise LogicError(f"{what} failed: initialization error (cuInit has not been called)")

    def owning_context(what: str) -> Context:
        need_init(what)
        ctx = current()
        if ctx is None:
            raise LogicError(f"{what}: explicit_context_dependent failed: invalid device context - "
                             "no currently active context?")
        return ctx

    def activate_for_free(ctx: Context) -> bool:
        """scoped_context_activation: True when the free may run here."""
        if current() is ctx:
            return True
        return threading.get_ident() == ctx.thread

    class Context:
        def __init__(self, handle: int) -> None:
            self.handle = handle
            self.thread = threading.get_ident()

        def push(self) -> None:
            need_init("cuCtxPushCurrent")
            stack().append(self)
            machine.context_stack().append(self.handle)

        @staticmethod
        def pop() -> None:
            st = stack()
            if not st:
                raise LogicError("context::pop: cannot pop non-current context")
            st.pop()
            ds = machine.context_stack()
            if ds:
                ds.pop()

        def detach(self) -> None:
            st = stack()
            if st and st[-1] is self:
                Context.pop()

        @staticmethod
        def synchronize() -> None:
            try:
                machine.synchronize_all()
            except CudaError as exc:
                raise _raise(exc) from exc

        @staticmethod
        def get_current() -> Context | None:
            return current()

    class Device:
        def __init__(self, ordinal: int) -> None:
            need_init("cuDeviceGet")
            if ordinal != 0:
                raise LogicError(f"cuDeviceGet failed: invalid device ordinal {ordinal}")
            self.ordinal = ordinal

        @staticmethod
        def count() -> int:
            need_init("cuDeviceGetCount")
            return 1

        def name(self) -> str:
            return machine.gpu.name

        def compute_capability(self) -> tuple[int, int]:
            return machine.gpu.compute_capability

        def total_memory(self) -> int:
            return machine.gpu.total_memory_bytes

        def retain_primary_context(self) -> Context:
            return Context(machine.primary_context)

        def make_context(self, flags: int = 0) -> Context:
            ctx = Context(machine._new_handle())
            ctx.push()
            return ctx

    class DeviceAllocation:
        def __init__(self, nbytes: int) -> None:
            self._ctx = owning_context("cuMemAlloc")
            try:
                self._ptr = machine.alloc(int(nbytes))
            except CudaError as exc:
                raise _raise(exc) from exc
            self._valid = True
            self.finalizerr = finalizer(self, _free_device, machine, self._ptr, self._ctx,
                                               activate_for_free)

        def __int__(self) -> int:
            return self._ptr

        def __index__(self) -> int:
            return self._ptr

        def free(self) -> None:
            if not self._valid:
                raise LogicError("device_allocation::free failed: invalid resource handle")
            self._valid = False
            self.finalizerr()

    class HostAllocation:
        """The base of a page-locked array (its `.base`), freed by free() or when collected."""

        def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
            self._ctx = owning_context("cuMemHostAlloc")
            try:
                machine.unsafe_call("cuMemHostAlloc")
            except CudaError as exc:
                raise _raise(exc) from exc
            self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            self._buf = (np.ctypeslib.ctypes.c_uint8 * max(self.nbytes, 1))()
            self.__array_interface__ = {
                "shape": shape, "typestr": dtype.str, "version": 3,
                "data": (np.ctypeslib.ctypes.addressof(self._buf), False),
            }
            self._valid = True
            with machine.lock:
                machine.pinned_bytes += self.nbytes
                machine.pinned_ranges[id(self)] = (np.ctypeslib.ctypes.addressof(self._buf), self.nbytes)
            self.finalizerr = finalizer(self, _free_host, machine, id(self), self.nbytes, self._ctx,
                                               activate_for_free)

        def free(self) -> None:
            if not self._valid:
                raise LogicError("pagelocked_host_allocation::free failed: invalid resource handle")
            self._valid = False
            self.finalizerr.detach()
            _free_host(machine, id(self), self.nbytes, self._ctx, activate_for_free, explicit=True)
            # the freed range is remembered (a copy from it fails) while the array exists
            finalizer(self, machine.freed_pinned.pop, id(self), None)

    def pagelocked_empty(shape: Sequence[int] | int, dtype: Any, order: str = "C", mem_flags: int = 0) -> np.ndarray:
        shp = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        return np.asarray(HostAllocation(shp, np.dtype(dtype)))

    class Stream:
        def __init__(self, flags: int = 0) -> None:
            self._ctx = owning_context("cuStreamCreate")
            try:
                self.handle = machine.create_stream(int(flags))
            except CudaError as exc:
                raise _raise(exc) from exc
            self.flags = int(flags)
            finalizer(self, machine.destroy_stream, self.handle)

        def synchronize(self) -> None:
            try:
                machine.synchronize(self.handle)
            except CudaError as exc:
                raise _raise(exc) from exc

        def is_done(self) -> bool:
            st = machine.stream(self.handle, "cuStreamQuery")
            return st is None or not st.pending

    def _stream_handle(stream: Stream | None) -> int:
        return 0 if stream is None else stream.handle

    def _device(addr: int, nbytes: int, what: str) -> int:
        """pycuda passes the address to the driver, which validates it (CUDA_ERROR_INVALID_VALUE)."""
        a = int(addr)
        if machine.find(a, nbytes) is None:
            raise LogicError(f"{what} failed: invalid argument ([{a:#x}, +{nbytes}) is not device memory)")
        return a

    def _submit(stream: Stream | None, op: Op) -> None:
        try:
            machine.enqueue(_stream_handle(stream), op)
        except CudaError as exc:
            raise _raise(exc) from exc

    def _host_bytes(arr: np.ndarray) -> np.ndarray:
        """The array's bytes, sharing its memory (pycuda takes a buffer with PyBUF_ANY_CONTIGUOUS)."""
        a = np.asarray(arr)
        if not (a.flags.c_contiguous or a.flags.f_contiguous):
            raise BufferError("ndarray is not contiguous")
        return a.reshape(-1, order="A").view(np.uint8)

    def _host_side(arr: np.ndarray, handle: int, what: str) -> str:
        """Page-locked or pageable (CUDA runtime API, "API synchronization behavior"): async copies with
        pageable memory synchronize the stream first; freed page-locked memory is an invalid argument."""
        kind = machine.host_kind(int(arr.ctypes.data), arr.nbytes)
        if kind == "freed":
            raise LogicError(f"{what} failed: invalid argument (page-locked host memory already freed)")
        if kind == "pageable" and arr.nbytes:
            if machine.capturing(handle) is not None:
                # GUESS: the stream sync a pageable copy needs is not allowed while capturing
                machine.invalidate_capture(handle, f"{what} with pageable host memory")
                raise LogicError(f"{what} failed: operation not permitted when stream is capturing "
                                 "(pageable host memory)")
            try:
                machine.synchronize(handle)
            except CudaError as exc:
                raise _raise(exc) from exc
        return kind

    def _still_pinned(host: np.ndarray, what: str) -> None:
        if machine.host_kind(int(host.ctypes.data), host.nbytes) != "pinned":
            raise CudaError(ILLEGAL_ADDRESS, f"{what}: its page-locked host memory was freed")

    def memcpy_htod_async(dest: int, src: np.ndarray, stream: Stream | None = None) -> None:
        host = _host_bytes(src)
        d = _device(dest, host.nbytes, "cuMemcpyHtoDAsync")
        if _host_side(host, _stream_handle(stream), "cuMemcpyHtoDAsync") == "pageable":
            staged = host.copy()  # "returns once the pageable buffer has been copied to the staging memory"

            def run_staged() -> None:
                machine.span(d, staged.nbytes, "cuMemcpyHtoDAsync")[...] = staged

            _submit(stream, Op("cuMemcpyHtoDAsync", run_staged))
            return

        def run() -> None:
            _still_pinned(host, "cuMemcpyHtoDAsync")
            machine.span(d, host.nbytes, "cuMemcpyHtoDAsync")[...] = host

        _submit(stream, Op("cuMemcpyHtoDAsync", run))

    def memcpy_dtoh_async(dest: np.ndarray, src: int, stream: Stream | None = None) -> None:
        if not dest.flags.writeable:
            raise BufferError("memcpy_dtoh_async: the destination is not writable")
        out = _host_bytes(dest)
        s = _device(src, out.nbytes, "cuMemcpyDtoHAsync")
        if _host_side(out, _stream_handle(stream), "cuMemcpyDtoHAsync") == "pageable":
            # "for transfers from device memory to pageable host memory, the function will return only
            # once the copy has completed"
            out[...] = machine.span(s, out.nbytes, "cuMemcpyDtoHAsync")
            return

        def run() -> None:
            _still_pinned(out, "cuMemcpyDtoHAsync")
            out[...] = machine.span(s, out.nbytes, "cuMemcpyDtoHAsync")

        _submit(stream, Op("cuMemcpyDtoHAsync", run))

    def memcpy_dtod_async(dest: int, src: int, size: int, stream: Stream | None = None) -> None:
        n = int(size)
        d = _device(dest, n, "cuMemcpyDtoDAsync")
        s = _device(src, n, "cuMemcpyDtoDAsync")

        def run() -> None:
            machine.span(d, n, "cuMemcpyDtoDAsync")[...] = machine.span(s, n, "cuMemcpyDtoDAsync").copy()

        _submit(stream, Op("cuMemcpyDtoDAsync", run))

    def memset_d8_async(dest: int, data: int, count: int, stream: Stream | None = None) -> None:
        n = int(count)
        d = _device(dest, n, "cuMemsetD8Async")

        def run() -> None:
            machine.span(d, n, "cuMemsetD8Async")[...] = int(data) & 0xFF

        _submit(stream, Op("cuMemsetD8Async", run))

    class Memcpy2D:
        """cuMemcpy2DAsync between device buffers (the fields pycuda's Memcpy2D exposes)."""

        def __init__(self) -> None:
            self.src_x_in_bytes = self.dst_x_in_bytes = 0
            self.src_y = self.dst_y = 0
            self.src_pitch = self.dst_pitch = 0
            self.width_in_bytes = self.height = 0
            self._src: int | None = None
            self._dst: int | None = None

        def set_src_device(self, ptr: int) -> None:
            self._src = int(ptr)

        def set_dst_device(self, ptr: int) -> None:
            self._dst = int(ptr)

        def __call__(self, stream: Stream | None = None) -> None:
            if self._src is None or self._dst is None:
                raise LogicError("Memcpy2D: source and destination must be set")
            w, h = int(self.width_in_bytes), int(self.height)
            if w > self.src_pitch or w > self.dst_pitch:
                # cuMemcpy2D: "WidthInBytes ... must not exceed either srcPitch or dstPitch"
                raise LogicError("cuMemcpy2DAsync failed: invalid argument (width exceeds a pitch)")
            src = self._src + self.src_x_in_bytes + self.src_y * self.src_pitch
            dst = self._dst + self.dst_x_in_bytes + self.dst_y * self.dst_pitch
            sp, dp = int(self.src_pitch), int(self.dst_pitch)
            if h > 0:
                _device(src, sp * (h - 1) + w, "cuMemcpy2DAsync")
                _device(dst, dp * (h - 1) + w, "cuMemcpy2DAsync")

            def run() -> None:
                for r in range(h):
                    row = machine.span(src + r * sp, w, "cuMemcpy2DAsync").copy()
                    machine.span(dst + r * dp, w, "cuMemcpy2DAsync")[...] = row

            _submit(stream, Op("cuMemcpy2DAsync", run))

    def init(flags: int = 0) -> None:
        machine.initialized = True

    def mem_alloc(nbytes: int) -> DeviceAllocation:
        return DeviceAllocation(nbytes)

    def mem_get_info() -> tuple[int, int]:
        owning_context("cuMemGetInfo")
        total = machine.gpu.total_memory_bytes
        return total - machine.used_bytes(), total

    def get_driver_version() -> int:
        return machine.gpu.driver_version

    for name, value in {
        "Error": Error, "LogicError": LogicError, "LaunchError": LaunchError, "RuntimeError": CudaRuntimeError,
        "MemoryError": CudaMemoryError, "Context": Context, "Device": Device, "DeviceAllocation": DeviceAllocation,
        "PagelockedHostAllocation": HostAllocation, "Stream": Stream, "Memcpy2D": Memcpy2D, "init": init,
        "mem_alloc": mem_alloc, "mem_get_info": mem_get_info, "pagelocked_empty": pagelocked_empty,
        "memcpy_htod_async": memcpy_htod_async, "memcpy_dtoh_async": memcpy_dtoh_async,
        "memcpy_dtod_async": memcpy_dtod_async, "memset_d8_async": memset_d8_async,
        "get_driver_version": get_driver_version,
    }.items():
        setattr(mod, name, value)
    return mod


def _free_device(machine: Machine, ptr: int, ctx: Any, may_free: Any) -> None:
    if not may_free(ctx):
        machine.skipped_frees.append(f"device allocation {ptr:#x}: freed outside its context (leaked)")
        return
    if defer(_free_device, machine, ptr, ctx, lambda _ctx: True):  # collected in a locked section (TrackedRLock)
        return
    try:
        machine.free(ptr)
    except CudaError as exc:
        machine.errors.append(f"cuMemFree: {exc}")


def _free_host(machine: Machine, key: int, nbytes: int, ctx: Any, may_free: Any, explicit: bool = False) -> None:
    if not may_free(ctx):
        machine.skipped_frees.append(f"page-locked {nbytes} bytes: freed outside its context (leaked)")
        return
    if defer(_free_host, machine, key, nbytes, ctx, lambda _ctx: True, explicit):  # as _free_device
        return
    try:
        machine.unsafe_call("cuMemFreeHost")
    except CudaError as exc:  # pycuda's CUDAPP_CALL_GUARDED_CLEANUP: a warning, the memory stays
        machine.errors.append(f"page-locked free failed: {exc}")
        return
    if machine.fault is None:
        try:  # GUESS: like cuMemFree, freeing page-locked memory waits for the work queued before it
            machine.synchronize_all()
        except CudaError as exc:
            machine.errors.append(f"work queued before cuMemFreeHost failed: {exc}")
    with machine.lock:
        machine.pinned_bytes -= nbytes
        rng = machine.pinned_ranges.pop(key, None)
        if rng is not None and explicit:
            machine.freed_pinned[key] = rng


def _thread_end(machine: Machine, stack: list[Any], thread: str) -> None:
    if stack:
        machine.errors.append(f"thread {thread} ended with {len(stack)} context(s) on pycuda's stack: "
                              "pycuda aborts the process (context_stack destructor)")
