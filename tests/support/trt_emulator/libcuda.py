"""An emulated `libcuda.so.1`: the CUDA driver API functions cosyedge calls through ctypes
(gpu_probe.py's probe, cuda.py's context binding and graph capture), as real C function pointers
(ctypes CFUNCTYPE), so cosyedge's ctypes calls — byref out-parameters included — run unchanged.

CUDA driver API reference: https://docs.nvidia.com/cuda/cuda-driver-api/index.html
(Initialization, Device Management, Primary Context Management, Context Management, Memory
Management, Stream Management, Graph Management)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from tests.support.trt_emulator.machine import (
    INVALID_VALUE,
    NOT_INITIALIZED,
    SUCCESS,
    UNKNOWN,
    CudaError,
    Machine,
)

_c_int, _vp, _size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
# cuDeviceGetAttribute ids (cuda.h CUdevice_attribute)
_ATTRS = {16: "multiprocessors", 75: "cc_major", 76: "cc_minor"}
INVALID_DEVICE = 101


class EmulatedLibcuda:
    """The functions as attributes, like a ctypes.CDLL; each returns a CUresult."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self._keep: list[Any] = []
        m = machine
        self._fn("cuInit", [ctypes.c_uint], lambda flags: self._init())
        self._fn("cuDriverGetVersion", [_vp], lambda p: self._out(p, _c_int, m.gpu.driver_version))
        self._fn("cuDeviceGetCount", [_vp], lambda p: self._ready() or self._out(p, _c_int, 1))
        self._fn("cuDeviceGet", [_vp, _c_int], lambda p, i: self._ready() or self._device(i) or self._out(p, _c_int, i))
        self._fn("cuDeviceGetName", [_vp, _c_int, _c_int], self._name)
        self._fn("cuDeviceGetAttribute", [_vp, _c_int, _c_int], self._attribute)
        self._fn("cuDeviceTotalMem_v2", [_vp, _c_int],
                 lambda p, d: self._device(d) or self._out(p, _size_t, m.gpu.total_memory_bytes))
        self._fn("cuDevicePrimaryCtxRetain", [_vp, _c_int],
                 lambda p, d: self._ready() or self._device(d) or self._out(p, _vp, m.primary_context))
        self._fn("cuDevicePrimaryCtxRelease_v2", [_c_int], lambda d: self._device(d) or SUCCESS)
        self._fn("cuCtxSetCurrent", [_vp], self._set_current)
        self._fn("cuMemGetInfo_v2", [_vp, _vp], self._mem_info)
        # Memory Management: cuMemAlloc_v2, cuMemFree_v2, cuMemsetD8_v2, cuMemcpyDtoH_v2 (each on the
        # legacy stream: the API synchronization behavior page; the emulator runs them at once, after
        # the work queued before them); Context Management: cuCtxSynchronize
        self._fn("cuMemAlloc_v2", [_vp, _size_t], lambda p, n: self._out(p, ctypes.c_uint64, m.alloc(n)))
        self._fn("cuMemFree_v2", [ctypes.c_uint64], self._free)
        self._fn("cuMemsetD8_v2", [ctypes.c_uint64, ctypes.c_ubyte, _size_t], self._memset)
        self._fn("cuMemcpyDtoH_v2", [_vp, ctypes.c_uint64, _size_t], self._dtoh)
        self._fn("cuCtxSynchronize", [], self._synchronize)
        self._fn("cuStreamBeginCapture_v2", [_vp, _c_int], lambda s, mode: m.begin_capture(s or 0, mode) or SUCCESS)
        self._fn("cuStreamEndCapture", [_vp, _vp], lambda s, p: self._out(p, _vp, m.end_capture(s or 0)))
        self._fn("cuGraphInstantiateWithFlags", [_vp, _vp, ctypes.c_ulonglong],
                 lambda p, g, flags: self._out(p, _vp, m.instantiate(g or 0)))
        self._fn("cuGraphLaunch", [_vp, _vp], lambda e, s: m.launch(e or 0, s or 0) or SUCCESS)
        self._fn("cuGraphExecDestroy", [_vp], lambda e: m.destroy_exec(e or 0) or SUCCESS)
        self._fn("cuGraphDestroy", [_vp], lambda g: m.destroy_graph(g or 0) or SUCCESS)

    def __getattr__(self, name: str) -> Any:
        # only reached for functions the emulator lacks (like ctypes.CDLL for a missing symbol)
        raise AttributeError(f"emulated libcuda has no function {name}")

    def _fn(self, name: str, argtypes: list[Any], body: Callable[..., int]) -> None:
        proto = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)
        machine = self.machine

        def call(*args: Any) -> int:
            # an exception must not escape a C callback (ctypes would return 0: success)
            try:
                return int(body(*args))
            except CudaError as exc:
                return exc.code
            except Exception as exc:  # an emulator bug: fail the call and let tests see it
                machine.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                return UNKNOWN

        fp = proto(call)
        self._keep.append(fp)
        setattr(self, name, fp)

    def _init(self) -> int:
        self.machine.initialized = True
        return SUCCESS

    def _ready(self) -> int:
        return SUCCESS if self.machine.initialized else NOT_INITIALIZED

    @staticmethod
    def _device(ordinal: int) -> int:
        return SUCCESS if ordinal == 0 else INVALID_DEVICE

    @staticmethod
    def _out(ptr: int | None, ctype: Any, value: int) -> int:
        if not ptr:
            return INVALID_VALUE
        ctype.from_address(ptr).value = value
        return SUCCESS

    def _name(self, buf: int | None, size: int, dev: int) -> int:
        if not buf or size <= 0:
            return INVALID_VALUE
        raw = self.machine.gpu.name.encode()[: size - 1] + b"\0"
        ctypes.memmove(buf, raw, len(raw))
        return self._device(dev)

    def _attribute(self, ptr: int | None, attr: int, dev: int) -> int:
        gpu = self.machine.gpu
        values = {"multiprocessors": gpu.multiprocessors, "cc_major": gpu.compute_capability[0],
                  "cc_minor": gpu.compute_capability[1]}
        key = _ATTRS.get(attr)
        if key is None:
            return INVALID_VALUE  # GUESS: only the attributes cosyedge reads are emulated
        return self._device(dev) or self._out(ptr, _c_int, values[key])

    def _set_current(self, ctx: int | None) -> int:
        if not self.machine.initialized:
            return NOT_INITIALIZED
        if ctx and ctx != self.machine.primary_context:
            return 201  # CUDA_ERROR_INVALID_CONTEXT (GUESS: only the primary context is known here)
        self.machine.set_current(ctx or 0)
        return SUCCESS

    def _free(self, addr: int) -> int:
        self.machine.require_context("cuMemFree")
        self.machine.free(addr)
        return SUCCESS

    def _synchronize(self) -> int:
        self.machine.require_context("cuCtxSynchronize")
        self.machine.synchronize_all()
        return SUCCESS

    def _memset(self, addr: int, value: int, count: int) -> int:
        self.machine.require_context("cuMemsetD8")
        self.machine.synchronize_all()
        self.machine.span(addr, count, "cuMemsetD8")[:] = value
        return SUCCESS

    def _dtoh(self, host: int | None, addr: int, count: int) -> int:
        self.machine.require_context("cuMemcpyDtoH")
        self.machine.synchronize_all()
        if not host:
            return INVALID_VALUE
        ctypes.memmove(host, self.machine.span(addr, count, "cuMemcpyDtoH").ctypes.data, count)
        return SUCCESS

    def _mem_info(self, free_ptr: int | None, total_ptr: int | None) -> int:
        self.machine.require_context("cuMemGetInfo")
        total = self.machine.gpu.total_memory_bytes
        return self._out(free_ptr, _size_t, total - self.machine.used_bytes()) or self._out(total_ptr, _size_t, total)
