"""The emulated pycuda driver layer and libcuda: device addresses, async copies, pycuda's context
rules, and CUDA graph capture (what invalidates a capture, what a replay uses), through cosyedge's
own CUDA layer (models/backends/cuda.py) where it has the call. Sources: docs/tensorrt-emulator.md."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.trt_emulator import Emulation
from tests.support.trt_emulator.samples import affine_model, affine_reference, build_plan


def test_addresses_inside_allocations_only(emulated_tensorrt: Emulation) -> None:
    from cosyedge_models.backends.cuda import DeviceBuffer, ThreadCuda, pinned_empty

    cuda = ThreadCuda(0)
    buf = DeviceBuffer(256)
    host = pinned_empty(64)
    host[...] = np.arange(64, dtype=np.uint8)
    cuda.htod(buf.ptr + 128, host)  # an offset inside the allocation
    back = pinned_empty(64)
    cuda.dtoh(back, buf.ptr + 128)
    assert not back.any()  # async: nothing arrives before the host synchronizes
    cuda.synchronize()
    np.testing.assert_array_equal(back, host)
    drv = emulated_tensorrt.pycuda_driver
    with pytest.raises(drv.LogicError):
        cuda.htod(buf.ptr + 224, host)  # runs 32 bytes past the end
    with pytest.raises(drv.LogicError):
        cuda.dtod(buf.ptr, 0x1234, 16)  # outside every allocation
    buf.close()
    with pytest.raises(drv.LogicError):
        cuda.htod(buf.ptr, host)  # freed


def test_pycuda_objects_need_a_context_on_its_stack(emulated_tensorrt: Emulation) -> None:
    drv = emulated_tensorrt.pycuda_driver
    drv.init()
    with pytest.raises(drv.LogicError, match="no currently active context"):
        drv.mem_alloc(16)
    ctx = drv.Device(0).retain_primary_context()
    ctx.push()
    try:
        assert int(drv.mem_alloc(16)) > 0
    finally:
        drv.Context.pop()


def _in_thread(fn: Any) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # reported to the test below
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors


def test_free_outside_its_context_is_skipped(emulated_tensorrt: Emulation) -> None:
    """pycuda's scoped_context_activation: another thread without the context on pycuda's stack cannot
    free the object; the free is skipped silently and the memory leaks."""
    from cosyedge_models.backends.cuda import ThreadCuda, free_pinned, pinned_empty, pycuda_scope

    ThreadCuda(0)
    emu = emulated_tensorrt
    base = emu.pinned_bytes()
    leaked = pinned_empty(1000)
    _in_thread(lambda: leaked.base.free())  # no context pushed on that thread
    assert emu.pinned_bytes() == base + 1000 and emu.machine.skipped_frees
    freed = pinned_empty(1000)

    def free_in_scope() -> None:
        with pycuda_scope(0):
            freed.base.free()

    _in_thread(free_in_scope)
    assert emu.pinned_bytes() == base + 1000  # only the first one leaked
    own = pinned_empty(500)
    free_pinned(own)  # cosyedge's explicit free pushes the context itself
    assert emu.pinned_bytes() == base + 1000


def test_thread_ending_with_a_pushed_context_is_an_abort(emulated_tensorrt: Emulation) -> None:
    drv = emulated_tensorrt.pycuda_driver
    drv.init()
    ctx = drv.Device(0).retain_primary_context()
    _in_thread(ctx.push)  # and never popped
    import gc

    gc.collect()
    assert any("aborts the process" in e for e in emulated_tensorrt.take_faults())


@pytest.fixture()
def static_engine(emulated_tensorrt: Emulation, tmp_path: Path) -> Any:
    from cosyedge_models.backends.tensorrt.backend import TrtBackend

    plan = build_plan(emulated_tensorrt.tensorrt, affine_model(tmp_path / "s.onnx", dynamic=False))
    assert plan is not None
    (tmp_path / "s.plan").write_bytes(plan)
    return TrtBackend().load("affine", tmp_path / "s.plan")


def _bound(session: Any) -> tuple[Any, Any, Any]:
    from cosyedge_models.backends.tensorrt.graph import TensorBuffers, set_addresses
    from cosyedge_models.backends.tensorrt.session import thread_cuda

    cuda = thread_cuda(0)
    bufs = TensorBuffers(session, ["x", "y"])
    ctx = session.engine.create_execution_context()
    set_addresses(session, ctx, {"x": bufs.ptr("x"), "y": bufs.ptr("y")})
    return cuda, bufs, ctx


def test_capture_needs_one_plain_enqueue_first(emulated_tensorrt: Emulation, static_engine: Any) -> None:
    from cosyedge_models.errors import SynthesisError

    cuda, bufs, ctx = _bound(static_engine)
    cuda.graphs.begin(cuda.handle)
    assert ctx.execute_async_v3(cuda.handle) is False  # a fresh context's first enqueue
    with pytest.raises(SynthesisError, match="cuStreamEndCapture"):
        cuda.graphs.end(cuda.handle)  # the capture was invalidated
    assert ctx.execute_async_v3(cuda.handle)
    cuda.synchronize()
    cuda.graphs.begin(cuda.handle)
    assert ctx.execute_async_v3(cuda.handle)
    cuda.graphs.end(cuda.handle).close()


def test_synchronizing_or_legacy_work_invalidates_a_capture(emulated_tensorrt: Emulation,
                                                            static_engine: Any) -> None:
    from cosyedge_models.backends.cuda import pycuda_scope
    from cosyedge_models.errors import SynthesisError

    drv = emulated_tensorrt.pycuda_driver
    cuda, bufs, ctx = _bound(static_engine)
    cuda.graphs.begin(cuda.handle)
    with pytest.raises(drv.LogicError):
        cuda.synchronize()
    with pytest.raises(SynthesisError):
        cuda.graphs.end(cuda.handle)
    with pycuda_scope(0):
        blocking = drv.Stream(0)
    for stream, invalidated in ((blocking, True), (cuda.stream, False)):  # cosyedge's is non-blocking
        cuda.graphs.begin(stream.handle)
        drv.memcpy_htod_async(bufs.ptr("x"), bufs.host("x"))  # work on the legacy stream (stream None)
        if invalidated:
            with pytest.raises(SynthesisError):
                cuda.graphs.end(stream.handle)
        else:
            cuda.graphs.end(stream.handle).close()


def test_replay_uses_the_addresses_bound_at_capture(emulated_tensorrt: Emulation, static_engine: Any) -> None:
    from cosyedge_models.backends.cuda import DeviceBuffer

    cuda, bufs, ctx = _bound(static_engine)
    x = np.random.default_rng(2).standard_normal((1, 8, 4)).astype(np.float32)
    bufs.host("x")[...] = x
    bufs.upload(cuda, ["x"])
    ctx.execute_async_v3(cuda.handle)
    cuda.synchronize()
    cuda.graphs.begin(cuda.handle)
    ctx.execute_async_v3(cuda.handle)
    graph = cuda.graphs.end(cuda.handle)
    other = DeviceBuffer(bufs.buffers["y"].device.nbytes)
    ctx.set_tensor_address("y", other.ptr)  # rebinding after the capture does not change the graph
    cuda.zero(bufs.ptr("y"), bufs.buffers["y"].device.nbytes)
    graph.launch(cuda.handle)
    bufs.download(cuda, ["y"])
    cuda.synchronize()
    np.testing.assert_allclose(bufs.host("y"), affine_reference(x), rtol=1e-6)
    graph.close()


def test_allocation_during_a_capture_is_refused_and_invalidates_it(emulated_tensorrt: Emulation,
                                                                   static_engine: Any) -> None:
    """cuThreadExchangeStreamCaptureMode: the capturing thread (THREAD_LOCAL) may not allocate or free."""
    from cosyedge_models.backends.cuda import DeviceBuffer, pinned_empty
    from cosyedge_models.errors import SynthesisError

    drv = emulated_tensorrt.pycuda_driver
    cuda, bufs, ctx = _bound(static_engine)
    cuda.graphs.begin(cuda.handle)
    with pytest.raises(drv.LogicError, match="capturing"):
        DeviceBuffer(64)
    with pytest.raises(drv.LogicError, match="capturing"):
        pinned_empty(64)
    with pytest.raises(SynthesisError):
        cuda.graphs.end(cuda.handle)
    errors: list[BaseException] = []

    def other_thread() -> None:  # another thread is unaffected by a THREAD_LOCAL capture
        try:
            DeviceBuffer(64, 0).close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    ctx.execute_async_v3(cuda.handle)
    cuda.synchronize()
    cuda.graphs.begin(cuda.handle)
    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    cuda.graphs.end(cuda.handle).close()
    assert not errors, errors


def test_one_context_used_by_two_threads_at_once_is_an_error(emulated_tensorrt: Emulation,
                                                              static_engine: Any) -> None:
    cuda, bufs, ctx = _bound(static_engine)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # stands for another thread inside a call on the same context
        with ctx._busy:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        assert ctx.execute_async_v3(cuda.handle) is False
    finally:
        release.set()
        t.join()
    assert any("another thread" in e for e in emulated_tensorrt.take_faults())
    assert ctx.execute_async_v3(cuda.handle)


def test_never_replaces_a_real_tensorrt(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from tests.support.trt_emulator import emulated_tensorrt as emulate

    real = types.ModuleType("tensorrt")
    real.Builder = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", real)
    with pytest.raises(RuntimeError, match="real TensorRT"), emulate():
        pass
    assert sys.modules["tensorrt"] is real


def test_pageable_copies_synchronize_and_freed_pinned_memory_fails(emulated_tensorrt: Emulation,
                                                                    static_engine: Any) -> None:
    """CUDA runtime API, "API synchronization behavior": a copy to pageable host memory returns when it is
    done; one from pageable memory stages the bytes at the call. Page-locked memory freed is gone:
    a copy naming it fails, and a graph replay that reaches it is an illegal address."""
    from cosyedge_models.backends.cuda import DeviceBuffer, free_pinned, pinned_empty

    drv = emulated_tensorrt.pycuda_driver
    cuda, bufs, ctx = _bound(static_engine)
    dev = DeviceBuffer(16)
    src = np.arange(16, dtype=np.uint8)  # pageable
    cuda.htod(dev.ptr, src)
    src[...] = 0  # the bytes were staged at the call
    out = np.zeros(16, np.uint8)  # pageable: the download is complete when the call returns
    cuda.dtoh(out, dev.ptr)
    np.testing.assert_array_equal(out, np.arange(16, dtype=np.uint8))
    pinned = pinned_empty(16)
    free_pinned(pinned)
    with pytest.raises(drv.LogicError, match="already freed"):
        cuda.dtoh(pinned, dev.ptr)
    # a captured download into page-locked memory freed before the replay
    ctx.execute_async_v3(cuda.handle)
    cuda.synchronize()
    cuda.graphs.begin(cuda.handle)
    bufs.download(cuda, ["y"])
    graph = cuda.graphs.end(cuda.handle)
    free_pinned(bufs.buffers["y"].host)
    graph.launch(cuda.handle)
    with pytest.raises(drv.LaunchError):
        cuda.synchronize()
    with pytest.raises(drv.LaunchError):  # sticky: the context is unusable afterwards
        cuda.htod(dev.ptr, src)
    assert any("sticky" in f for f in emulated_tensorrt.take_faults())


def test_probe_and_memory_report_see_the_emulated_gpu(emulated_tensorrt: Emulation) -> None:
    """gpu_probe's ctypes calls (cuInit, cuDeviceGet*, cuMemGetInfo_v2 ...) run against the emulated
    libcuda through the one seam, use_cuda_library."""
    from cosyedge_models.backends.cuda import DeviceBuffer, ThreadCuda
    from cosyedge_models.backends.gpu_probe import device_memory_used, local_identity, probe_gpu

    gpu = emulated_tensorrt.machine.gpu
    probe = probe_gpu()
    assert probe.available and probe.driver_version == gpu.driver_version
    dev = probe.devices[0]
    assert (dev.name, dev.compute_capability, dev.multiprocessors, dev.total_memory_bytes) == (
        gpu.name, "8.7", gpu.multiprocessors, gpu.total_memory_bytes)
    assert local_identity().tensorrt == emulated_tensorrt.env.full_version
    ThreadCuda(0)
    before = device_memory_used()
    buf = DeviceBuffer(1 << 20)
    assert device_memory_used() == (before or 0) + (1 << 20)
    buf.close()
    assert device_memory_used() == before


def test_everything_is_restored_after_the_emulation() -> None:
    import sys

    from cosyedge_models.backends.gpu_probe import probe_gpu

    from tests.support.trt_emulator import emulated_tensorrt as emulate

    before = {name: sys.modules.get(name) for name in ("tensorrt", "pycuda", "pycuda.driver")}
    outside = probe_gpu(refresh=True)
    with emulate() as emu:
        assert sys.modules["tensorrt"] is emu.tensorrt and probe_gpu().available
    assert {name: sys.modules.get(name) for name in before} == before
    assert probe_gpu() == outside


def test_a_driver_buffer_is_exact_zeroed_and_freed_once(emulated_tensorrt: Emulation) -> None:
    """DriverBuffer (the lanes' and slots' memory on ort-cuda): exactly its bytes, zeroed, read back,
    freed by close() and not twice; a zero size is refused before the driver."""
    from cosyedge_models.backends.cuda import DriverBuffer
    from cosyedge_models.errors import SynthesisError

    before = emulated_tensorrt.device_bytes()
    with DriverBuffer(3 * 1000 + 7) as buf:
        assert emulated_tensorrt.device_bytes() - before == 3007  # no rounding up
        span = emulated_tensorrt.machine.span(buf.ptr, 3007, "test")
        assert not span.any()
        span[10:14] = [1, 2, 3, 4]
        np.testing.assert_array_equal(buf.read(9, 6), [0, 1, 2, 3, 4, 0])
        with pytest.raises(SynthesisError, match="outside"):
            buf.read(3000, 8)
    assert emulated_tensorrt.device_bytes() == before
    buf.close()  # a second close frees nothing
    assert emulated_tensorrt.device_bytes() == before
    with pytest.raises(ValueError, match="at least one byte"):
        DriverBuffer(0)


def test_a_driver_buffer_larger_than_the_gpu_fails_clearly(emulated_tensorrt: Emulation) -> None:
    from cosyedge_models.backends.cuda import DriverBuffer
    from cosyedge_models.errors import SynthesisError

    total = emulated_tensorrt.machine.gpu.total_memory_bytes
    with pytest.raises(SynthesisError, match=r"cuMemAlloc of \d+ bytes failed with CUDA error 2"):
        DriverBuffer(total + 1)
    assert emulated_tensorrt.device_bytes() == 0


def test_a_free_collected_inside_a_locked_section_waits_until_the_thread_leaves_it(
        emulated_tensorrt: Emulation) -> None:
    """A collected allocation's free, whose implicit synchronization waits on the streams, runs once its
    thread holds no emulator lock: inside one it could deadlock with a thread that drains a stream and
    waits for that lock (machine.TrackedRLock; a CI run hung so)."""
    from cosyedge_models.backends.cuda import ThreadCuda, pycuda_scope

    ThreadCuda(0)
    emu = emulated_tensorrt
    with pycuda_scope(0):
        alloc = emu.pycuda_driver.mem_alloc(4096)
        before = emu.machine.used_bytes()
        with emu.machine.lock:
            del alloc  # its finalizer runs here, as the garbage collector's would inside any locked section
            assert emu.machine.used_bytes() == before  # put off
        assert emu.machine.used_bytes() == before - 4096
    assert not emu.machine.errors and not emu.machine.skipped_frees
