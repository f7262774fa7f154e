"""The TensorRT emulator's engine and execution-context rules (tensors by name, profiles,
execute_async_v3's refusals, device memory), each against the documented behaviour it emulates
(docs/tensorrt-emulator.md lists the sources)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.trt_emulator import Emulation
from tests.support.trt_emulator.samples import affine_model, affine_reference, build_plan

PROFILES = [{"x": ((1, 1, 4), (1, 8, 4), (1, 16, 4))}, {"x": ((2, 1, 4), (2, 32, 4), (4, 64, 4))}]


@dataclass
class Rig:
    emu: Emulation
    engine: Any
    drv: Any
    stream: Any
    held: list[Any]

    def alloc(self, nbytes: int) -> int:
        """Device memory, kept alive by the rig (pycuda frees an allocation when it is collected)."""
        self.held.append(self.drv.mem_alloc(nbytes))
        return int(self.held[-1])

    def upload(self, ptr: int, arr: np.ndarray) -> None:
        self.drv.memcpy_htod_async(ptr, np.ascontiguousarray(arr), self.stream)

    def download(self, ptr: int, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, np.float32)
        self.drv.memcpy_dtoh_async(out, ptr, self.stream)
        self.stream.synchronize()
        return out


@pytest.fixture()
def rig(emulated_tensorrt: Emulation, tmp_path: Path) -> Iterator[Rig]:
    trt, drv = emulated_tensorrt.tensorrt, emulated_tensorrt.pycuda_driver
    plan = build_plan(trt, affine_model(tmp_path / "a.onnx"), PROFILES)
    assert plan is not None
    drv.init()
    ctx = drv.Device(0).retain_primary_context()
    ctx.push()
    engine = trt.Runtime(trt.Logger()).deserialize_cuda_engine(plan)
    yield Rig(emulated_tensorrt, engine, drv, drv.Stream(), [])
    drv.Context.pop()


def _errors(rig: Rig) -> list[str]:
    return rig.emu.errors_logged()


def test_tensors_by_name(rig: Rig) -> None:
    trt, e = rig.emu.tensorrt, rig.engine
    assert [e.get_tensor_name(i) for i in range(e.num_io_tensors)] == ["x", "y"]
    assert e.get_tensor_mode("x") == trt.TensorIOMode.INPUT and e.get_tensor_mode("y") == trt.TensorIOMode.OUTPUT
    assert tuple(e.get_tensor_shape("x")) == (-1, -1, 4)
    assert e.get_tensor_mode("nope") == trt.TensorIOMode.NONE
    assert any("no tensor named nope" in m for m in _errors(rig))
    ctx = e.create_execution_context()
    assert ctx.set_tensor_address("nope", rig.alloc(16)) is False
    assert ctx.set_input_shape("y", (1, 2, 3)) is False  # an output has no input shape


def test_set_input_shape_outside_the_active_profile(rig: Rig) -> None:
    ctx = rig.engine.create_execution_context()
    assert ctx.active_optimization_profile == 0  # a new context starts on profile 0
    assert ctx.set_input_shape("x", (1, 16, 4)) is True
    assert ctx.set_input_shape("x", (2, 8, 4)) is False  # batch 2 is profile 1's
    assert any("does not satisfy any optimization profiles" in m for m in _errors(rig))
    assert ctx.set_optimization_profile_async(1, rig.stream.handle)
    assert ctx.set_input_shape("x", (2, 8, 4)) is True
    assert ctx.set_optimization_profile_async(2, rig.stream.handle) is False  # no profile 2


def test_profile_switch_invalidates_input_shapes(rig: Rig) -> None:
    ctx = rig.engine.create_execution_context()
    assert ctx.set_input_shape("x", (1, 5, 4))
    assert tuple(ctx.get_tensor_shape("y")) == (1, 5, 3)  # output shapes follow the inputs
    ctx.set_optimization_profile_async(1, rig.stream.handle)
    assert tuple(ctx.get_tensor_shape("y")) == (-1, -1, 3)
    assert ctx.all_input_dimensions_specified is False


@pytest.mark.parametrize("missing", ["shape", "input address", "output address", "short buffer"])
def test_execute_refuses_what_is_unset_or_too_small(rig: Rig, missing: str) -> None:
    ctx = rig.engine.create_execution_context()
    x, y = rig.alloc(5 * 4 * 4), rig.alloc(5 * 3 * 4)
    if missing != "shape":
        ctx.set_input_shape("x", (1, 5, 4))
    if missing != "input address":
        ctx.set_tensor_address("x", x)
    if missing != "output address":
        ctx.set_tensor_address("y", y if missing != "short buffer" else rig.alloc(5 * 3 * 4 - 4))
    assert ctx.execute_async_v3(rig.stream.handle) is False
    assert any("enqueueV3" in m for m in _errors(rig))


def test_execute_runs_the_graph_over_device_buffers(rig: Rig) -> None:
    ctx = rig.engine.create_execution_context()
    ctx.set_optimization_profile_async(1, rig.stream.handle)
    x = np.random.default_rng(0).standard_normal((3, 40, 4)).astype(np.float32)
    base = rig.alloc(4096 + x.nbytes)
    xp, yp = base + 4096, rig.alloc(3 * 40 * 3 * 4)  # an offset inside an allocation is a valid address
    rig.upload(xp, x)
    assert ctx.set_input_shape("x", x.shape) and ctx.set_tensor_address("x", xp) and ctx.set_tensor_address("y", yp)
    assert ctx.execute_async_v3(rig.stream.handle)
    np.testing.assert_allclose(rig.download(yp, (3, 40, 3)), affine_reference(x), rtol=1e-6)


def test_static_context_owns_its_activation_memory(rig: Rig) -> None:
    before = rig.emu.device_bytes()
    ctx = rig.engine.create_execution_context()
    assert rig.emu.device_bytes() - before == rig.engine.device_memory_size_v2 > 0
    del ctx
    assert rig.emu.device_bytes() == before


def test_user_managed_context_needs_device_memory(rig: Rig) -> None:
    trt = rig.emu.tensorrt
    before = rig.emu.device_bytes()
    ctx = rig.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
    assert rig.emu.device_bytes() == before  # nothing allocated for it
    x = np.ones((1, 2, 4), np.float32)
    xp, yp = rig.alloc(x.nbytes), rig.alloc(2 * 3 * 4)
    rig.upload(xp, x)
    ctx.set_input_shape("x", x.shape)
    ctx.set_tensor_address("x", xp)
    ctx.set_tensor_address("y", yp)
    assert ctx.execute_async_v3(rig.stream.handle) is False  # no device memory given
    need = rig.engine.device_memory_size_v2
    small = rig.alloc(need)
    ctx.set_device_memory(small, need - 256)  # smaller than device_memory_size_v2: refused
    assert ctx.execute_async_v3(rig.stream.handle) is False
    ctx.set_device_memory(small, need)
    assert ctx.execute_async_v3(rig.stream.handle)
    np.testing.assert_allclose(rig.download(yp, (1, 2, 3)), affine_reference(x), rtol=1e-6)


def test_tensor_addresses_must_be_256_byte_aligned(rig: Rig) -> None:
    ctx = rig.engine.create_execution_context()
    base = rig.alloc(4096)
    assert ctx.set_tensor_address("x", base + 128) is False  # inside the allocation, but misaligned
    assert any("256-byte aligned" in m for m in _errors(rig))
    assert ctx.set_tensor_address("x", base + 256)
