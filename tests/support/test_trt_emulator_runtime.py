"""The TensorRT emulator's runtime side, through cosyedge's own TrtBackend / TrtSession and the
CUDA layer (models/backends/cuda.py): a plan built by the emulated builder deserializes and runs,
results equal numpy's; plans from another TensorRT or GPU are refused; captured graphs replay with
the addresses bound at capture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.errors import BundleError

from tests.support.trt_emulator import RTX_4090, Emulation
from tests.support.trt_emulator import emulated_tensorrt as emulate
from tests.support.trt_emulator.samples import affine_model, affine_reference, build_plan

DYN = {"x": ((1, 1, 4), (1, 8, 4), (2, 16, 4))}


def _plan(emu: Emulation, tmp_path: Path, dynamic: bool = True) -> Path:
    onnx_path = affine_model(tmp_path / "affine.onnx", dynamic)
    plan = build_plan(emu.tensorrt, onnx_path, [DYN] if dynamic else None)
    assert plan is not None, emu.errors_logged()
    out = tmp_path / "affine.plan"
    out.write_bytes(plan)
    return out


def test_session_runs_a_built_plan(emulated_tensorrt: Emulation, tmp_path: Path) -> None:
    from cosyedge_models.backends.tensorrt.backend import TrtBackend

    backend = TrtBackend()
    session = backend.load("affine", _plan(emulated_tensorrt, tmp_path))
    assert session.input_names == ("x",) and session.output_names == ("y",)
    rng = np.random.default_rng(0)
    for shape in [(1, 5, 4), (2, 16, 4), (1, 1, 4)]:
        x = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(session.run({"x": x})["y"], affine_reference(x), rtol=1e-6)
    session.close()
    assert emulated_tensorrt.machine.errors == []


def test_shape_outside_the_profile_is_refused(emulated_tensorrt: Emulation, tmp_path: Path) -> None:
    from cosyedge_models.backends.tensorrt.backend import TrtBackend
    from cosyedge_models.errors import SynthesisError

    session = TrtBackend().load("affine", _plan(emulated_tensorrt, tmp_path))
    with pytest.raises(SynthesisError):
        session.run({"x": np.zeros((1, 17, 4), np.float32)})  # T above the profile's max 16


@pytest.mark.parametrize("other", [{"version": "10.3"}, {"gpu": RTX_4090}])
def test_plan_from_another_tensorrt_or_gpu_is_refused(tmp_path: Path, other: dict[str, object]) -> None:
    from cosyedge_models.backends.tensorrt.backend import TrtBackend

    with emulate("10.13") as emu:
        path = _plan(emu, tmp_path)
    with emulate(**other) as emu:  # type: ignore[arg-type]
        with pytest.raises(BundleError, match="could not deserialize"):
            TrtBackend().load("affine", path)
        assert any("deserializeCudaEngine" in m for m in emu.errors_logged())


def test_captured_graph_replays_the_bound_addresses(emulated_tensorrt: Emulation, tmp_path: Path) -> None:
    from cosyedge_models.backends.tensorrt.backend import TrtBackend
    from cosyedge_models.backends.tensorrt.graph import CapturedEnqueue, TensorBuffers, execute, set_addresses
    from cosyedge_models.backends.tensorrt.session import thread_cuda

    session = TrtBackend().load("affine", _plan(emulated_tensorrt, tmp_path, dynamic=False))
    cuda = thread_cuda(0)
    bufs = TensorBuffers(session, ["x", "y"])
    ctx = session.engine.create_execution_context()
    set_addresses(session, ctx, {"x": bufs.ptr("x"), "y": bufs.ptr("y")})

    def enqueue() -> None:
        bufs.upload(cuda, ["x"])
        execute(session, ctx, cuda)
        bufs.download(cuda, ["y"])

    step = CapturedEnqueue("affine", ctx, cuda, enqueue)
    assert step.prepare(capture=True)
    rng = np.random.default_rng(1)
    for _ in range(2):  # each replay reads the host inputs written just before it
        x = rng.standard_normal((1, 8, 4)).astype(np.float32)
        bufs.host("x")[...] = x
        step.run()
        cuda.synchronize()
        np.testing.assert_allclose(bufs.host("y"), affine_reference(x), rtol=1e-6)
    # the graph keeps the output address it was captured with: free that buffer and the replay faults
    bufs.buffers["y"].device.close()
    step.run()
    with pytest.raises(Exception, match="illegal memory access|not inside a live device allocation"):
        cuda.synchronize()
    assert any("sticky" in f for f in emulated_tensorrt.take_faults())
