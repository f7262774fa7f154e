"""An emulator of the parts of TensorRT 10/11's Python API and of pycuda that cosyedge uses, for the
default test run on machines without an NVIDIA GPU (never installed with the package).

`emulated_tensorrt(version, gpu)` puts the emulated `tensorrt`, `pycuda` and `pycuda.driver` modules
in sys.modules and an emulated libcuda behind cosyedge_models.backends.gpu_probe.use_cuda_library
(so the GPU probe, cuda.py's contexts and its CUDA graph capture run on the emulated GPU); it
refuses to run where a real TensorRT is importable. What it emulates, the rules with their sources,
and what it had to guess: docs/tensorrt-emulator.md."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass

from tests.support.trt_emulator.libcuda import EmulatedLibcuda
from tests.support.trt_emulator.machine import EmulatedGpu, Machine
from tests.support.trt_emulator.pycuda_driver import make_driver
from tests.support.trt_emulator.tensorrt_module import TrtEnv, make_tensorrt
from tests.support.trt_emulator.trt_types import VERSIONS

__all__ = ["VERSIONS", "EmulatedGpu", "Emulation", "emulated_tensorrt", "real_tensorrt_present"]

_MODULES = ("tensorrt", "pycuda", "pycuda.driver")
_active: list[EmulatedLibcuda] = []  # emulations in place, innermost last (nesting restores the outer one)
JETSON_ORIN_NANO = EmulatedGpu()
RTX_4090 = EmulatedGpu("NVIDIA GeForce RTX 4090", (8, 9), 128, 25_386_352_640)


@dataclass
class Emulation:
    machine: Machine
    env: TrtEnv
    tensorrt: types.ModuleType
    pycuda_driver: types.ModuleType
    libcuda: EmulatedLibcuda

    @property
    def journal(self) -> list[tuple[int, str]]:
        """Everything the emulated TensorRT logged: (severity, message)."""
        return self.env.journal

    def errors_logged(self) -> list[str]:
        return [m for sev, m in self.env.journal if sev <= 1]

    def device_bytes(self) -> int:
        return self.machine.used_bytes()

    def pinned_bytes(self) -> int:
        return self.machine.pinned_bytes

    def faults(self) -> list[str]:
        """What a real GPU process would have died of or reported as a driver error: failures inside the
        emulator's C callbacks, a pycuda abort (a thread ending with a context on pycuda's stack), a
        sticky illegal address, work that failed on a destroyed stream. Empty when all went well."""
        out = list(self.machine.errors)
        if self.machine.fault is not None:
            out.append(f"sticky GPU fault: {self.machine.fault}")
        return out

    def take_faults(self) -> list[str]:
        """faults(), then forgotten (for a test that provokes one on purpose; the GPU works again)."""
        out = self.faults()
        self.machine.errors.clear()
        self.machine.fault = None
        return out


def real_tensorrt_present() -> bool:
    """A real `tensorrt` (not tensorrt-stubs' stub-only namespace) is importable."""
    loaded = sys.modules.get("tensorrt")
    if loaded is not None:
        # an emulation already in place (nested emulations are fine: the outer one checked)
        return not getattr(loaded, "__emulated__", False) and hasattr(loaded, "Builder")
    spec = importlib.util.find_spec("tensorrt")
    return spec is not None and spec.origin is not None and not spec.origin.endswith(".pyi")


@contextlib.contextmanager
def emulated_tensorrt(version: str = "10.13", gpu: EmulatedGpu | None = None) -> Iterator[Emulation]:
    """The emulator in place for the block; everything restored after it."""
    from cosyedge_models.backends import gpu_probe

    if real_tensorrt_present():
        raise RuntimeError("a real TensorRT is importable here: the emulator never replaces it")
    machine = Machine(gpu or JETSON_ORIN_NANO)
    env = TrtEnv(machine, version)
    trt = make_tensorrt(env)
    trt.__emulated__ = True  # type: ignore[attr-defined]
    drv = make_driver(machine)
    pkg = types.ModuleType("pycuda")
    pkg.__path__ = []  # a package, so `import pycuda.driver` resolves from sys.modules
    pkg.driver = drv  # type: ignore[attr-defined]
    lib = EmulatedLibcuda(machine)
    saved = {name: sys.modules.get(name) for name in _MODULES}
    no_gpu = os.environ.pop("COSYEDGE_NO_GPU", None)
    sys.modules.update({"tensorrt": trt, "pycuda": pkg, "pycuda.driver": drv})
    gpu_probe.use_cuda_library(lib)
    _active.append(lib)
    try:
        yield Emulation(machine, env, trt, drv, lib)
    finally:
        _active.remove(lib)
        gpu_probe.use_cuda_library(_active[-1] if _active else None)
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
        if no_gpu is not None:
            os.environ["COSYEDGE_NO_GPU"] = no_gpu
