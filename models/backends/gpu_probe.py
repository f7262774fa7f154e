"""Is there a GPU and a real TensorRT here? Answered without touching
TensorRT first: importing or using TensorRT on a machine without a GPU can
segfault, so the GPU is probed through the CUDA driver library with ctypes
(cuInit + cuDeviceGetCount), and only then is `tensorrt` imported.

The `tensorrt-stubs` package (type checking in CI) installs an importable but
empty `tensorrt` namespace package, so a successful import proves nothing:
real TensorRT is recognised by its attributes (`Builder`, `__version__`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib
import os
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

from cosyedge_models.backends.engine_meta import EngineIdentity

# cuDeviceGetAttribute ids (CUDA driver API, stable since CUDA 2.x)
_ATTR_MULTIPROCESSOR_COUNT = 16
_ATTR_CC_MAJOR = 75
_ATTR_CC_MINOR = 76
_LIBCUDA = ("libcuda.so.1", "libcuda.so")


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    compute_capability: str
    multiprocessors: int
    total_memory_bytes: int


@dataclass(frozen=True)
class GpuProbe:
    available: bool
    reason: str  # why not, or a one-line summary
    driver_version: int | None = None  # e.g. 12060 for CUDA 12.6
    devices: tuple[GpuDevice, ...] = field(default_factory=tuple)


def _device_nodes() -> list[str]:
    # dGPU: /dev/nvidia0...; Jetson (nvgpu): /dev/nvhost-ctrl-gpu, /dev/nvgpu/igpu0, /dev/nvmap.
    return sorted(glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/nvhost-*gpu*") + glob.glob("/dev/nvgpu/*"))


class CudaLibrary(Protocol):
    """The CUDA driver library as ctypes exposes it: functions by name, each returning a CUresult."""

    def __getattr__(self, name: str) -> Any: ...


_library_lock = threading.Lock()
_library_override: CudaLibrary | None = None
_library_generation = 0


def use_cuda_library(lib: CudaLibrary | None) -> None:
    """Test seam: the CUDA driver library to use instead of libcuda.so.1 (the TensorRT emulator in
    tests/support/trt_emulator gives one), or None for the real one. Drops every cached answer: the
    probe here, and (through cuda_library_generation) cuda.py's driver, contexts and library."""
    global _library_override, _library_generation, _probe_cache
    with _library_lock:
        _library_override = lib
        _library_generation += 1
    with _probe_lock:
        _probe_cache = None


def cuda_library_generation() -> int:
    """Changes whenever use_cuda_library is called: caches built on the library compare it."""
    return _library_generation


def cuda_library() -> CudaLibrary | None:
    """The CUDA driver library: the one use_cuda_library set, else libcuda.so.1 (None if absent)."""
    with _library_lock:
        override = _library_override
    return override if override is not None else _load_libcuda()


def _load_libcuda() -> ctypes.CDLL | None:
    names = list(_LIBCUDA)
    found = ctypes.util.find_library("cuda")
    if found:
        names.append(found)
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


_probe_lock = threading.Lock()
_probe_cache: GpuProbe | None = None


def probe_gpu(refresh: bool = False) -> GpuProbe:
    """GPU presence through the CUDA driver (cached; the driver never changes
    under a running process)."""
    global _probe_cache
    with _probe_lock:
        if _probe_cache is None or refresh:
            _probe_cache = _probe_uncached()
        return _probe_cache


def _probe_uncached() -> GpuProbe:
    if os.environ.get("COSYEDGE_NO_GPU"):
        return GpuProbe(False, "COSYEDGE_NO_GPU is set")
    with _library_lock:
        override = _library_override
    # a library given explicitly (use_cuda_library) stands for the driver and its device nodes
    nodes = ["(given library)"] if override is not None else _device_nodes()
    if not nodes:
        return GpuProbe(False, "no NVIDIA device node (/dev/nvidia0 or Jetson /dev/nvhost-*gpu*, /dev/nvgpu/*)")
    lib = cuda_library()
    if lib is None:
        return GpuProbe(False, f"device nodes exist ({nodes[0]}) but libcuda.so.1 cannot be loaded; "
                               "install the NVIDIA driver (on Jetson: JetPack)")
    rc = lib.cuInit(0)
    if rc != 0:
        return GpuProbe(False, f"cuInit failed with CUDA error {rc} (driver present but no usable GPU)")
    version = ctypes.c_int(0)
    lib.cuDriverGetVersion(ctypes.byref(version))
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return GpuProbe(False, "the CUDA driver reports no GPU", version.value)
    devices = []
    for i in range(count.value):
        dev = ctypes.c_int(0)
        if lib.cuDeviceGet(ctypes.byref(dev), i) != 0:
            continue
        buf = ctypes.create_string_buffer(256)
        lib.cuDeviceGetName(buf, 256, dev)
        vals = []
        for attr in (_ATTR_CC_MAJOR, _ATTR_CC_MINOR, _ATTR_MULTIPROCESSOR_COUNT):
            v = ctypes.c_int(0)
            lib.cuDeviceGetAttribute(ctypes.byref(v), attr, dev)
            vals.append(v.value)
        mem = ctypes.c_size_t(0)
        lib.cuDeviceTotalMem_v2(ctypes.byref(mem), dev)
        devices.append(GpuDevice(i, buf.value.decode(errors="replace"), f"{vals[0]}.{vals[1]}", vals[2], mem.value))
    if not devices:
        return GpuProbe(False, "the CUDA driver lists GPUs but none could be opened", version.value)
    summary = ", ".join(f"{d.index}: {d.name} (cc {d.compute_capability})" for d in devices)
    return GpuProbe(True, summary, version.value, tuple(devices))


def device_memory_used(device_id: int = 0) -> int | None:
    """Bytes in use on the GPU (all processes: cuMemGetInfo's total - free) with the device's
    primary context, the one onnxruntime and TensorRT use, current on this thread; None
    without a GPU. For memory reports: the growth while an engine loads is its device memory."""
    if not probe_gpu().available:
        return None
    lib = cuda_library()
    if lib is None:
        return None
    dev, ctx = ctypes.c_int(0), ctypes.c_void_p(0)
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    if (lib.cuDeviceGet(ctypes.byref(dev), device_id) != 0
            or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0):
        return None
    try:
        if lib.cuCtxSetCurrent(ctx) != 0 or lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(dev)  # the runtime holds its own reference while it uses it
    return int(total.value - free.value)


@dataclass(frozen=True)
class TrtProbe:
    available: bool
    reason: str
    version: str | None = None


def _is_real_tensorrt(mod: ModuleType) -> bool:
    return hasattr(mod, "Builder") and hasattr(mod, "Runtime") and isinstance(getattr(mod, "__version__", None), str)


def probe_tensorrt() -> TrtProbe:
    """Real TensorRT importable here? Imports it only when a GPU is present."""
    gpu = probe_gpu()
    if not gpu.available:
        return TrtProbe(False, f"no GPU: {gpu.reason}")
    try:
        mod = importlib.import_module("tensorrt")
    except ImportError as exc:
        return TrtProbe(False, f"the tensorrt Python package is not installed ({exc}); on Jetson it comes with "
                               "JetPack: apt-get install python3-libnvinfer (and use a venv with "
                               "--system-site-packages)")
    if not _is_real_tensorrt(mod):
        return TrtProbe(False, "the importable 'tensorrt' is only the type stubs (tensorrt-stubs), not TensorRT; "
                               "install TensorRT (on Jetson: JetPack's python3-libnvinfer)")
    return TrtProbe(True, f"TensorRT {mod.__version__}", str(mod.__version__))


def import_tensorrt() -> ModuleType:
    """The real tensorrt module, or a MissingExtraError/SynthesisError saying why not."""
    from cosyedge_models.errors import SynthesisError

    probe = probe_tensorrt()
    if not probe.available:
        raise SynthesisError(f"TensorRT is not usable here: {probe.reason}")
    return importlib.import_module("tensorrt")


def local_identity(device_id: int = 0) -> EngineIdentity:
    """The GPU and TensorRT this process would run engines with."""
    from cosyedge_models.errors import SynthesisError

    gpu = probe_gpu()
    trt = probe_tensorrt()
    if not trt.available or trt.version is None:
        raise SynthesisError(f"TensorRT is not usable here: {trt.reason}")
    devices = {d.index: d for d in gpu.devices}
    if device_id not in devices:
        raise SynthesisError(f"GPU {device_id} does not exist (have: {sorted(devices)})")
    dev = devices[device_id]
    return EngineIdentity(trt.version, dev.name, dev.compute_capability, dev.multiprocessors)
