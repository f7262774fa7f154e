"""models/backends/cuda.py under the emulated libcuda + pycuda (tests/support/trt_emulator) in
the default run, or on a real GPU where TensorRT is installed (tests/support/trt_runtime.py):
pinned round trips, the KV plan's device copies against the host reference
(kv_layout.apply_host), a CUDA graph replay reading fresh pinned input, and one stream per thread."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from cosyedge_models.backends.gpu_probe import probe_gpu
from cosyedge_models.backends.kv_layout import (
    Copy2D,
    KvPlan,
    MaskFill,
    MaskSet,
    apply_host,
    bucket_mask,
    decode_buckets,
)

from tests.support.components import missing
from tests.support.trt_emulator import Emulation


@pytest.fixture(scope="module", autouse=True)
def _cuda(trt_runtime: Emulation | None) -> Emulation | None:
    """The emulated libcuda + pycuda in the default run, a real GPU where TensorRT is installed."""
    if trt_runtime is None and importlib.util.find_spec("pycuda") is None:
        missing("CUDA layer tests on a real TensorRT need pycuda (pip install pycuda==2025.1.2)")
    return trt_runtime


@pytest.fixture(autouse=True)
def _no_faults(_cuda: Emulation | None) -> Iterator[None]:
    """What would have faulted a real GPU (even if the test caught it) fails the test."""
    yield
    if _cuda is not None:
        assert _cuda.faults() == []


def test_probe_reads_the_device() -> None:
    from cosyedge_models.backends.cuda import device_info

    gpu = probe_gpu()
    dev = gpu.devices[0]
    info = device_info(0)
    assert (info.name, info.compute_capability) == (dev.name, dev.compute_capability)
    assert dev.multiprocessors > 0 and dev.total_memory_bytes > 0 and gpu.driver_version


def test_kv_plan_ops_on_device_match_host_reference() -> None:
    from cosyedge_models.backends.cuda import DeviceBuffer, pinned_empty
    from cosyedge_models.backends.tensorrt.session import thread_cuda

    cuda = thread_cuda(0)
    rows, hd, p_max = 6, 4, 40
    plan = KvPlan(rows, hd, 4, p_max, decode_buckets(1, p_max, smallest=8))
    cap = rows * (p_max + 1) * hd * 4
    dev = {k: DeviceBuffer(cap) for k in "ab"}
    mask_dev = DeviceBuffer((p_max + 1) * 8)
    host = {k: np.zeros(cap, np.uint8) for k in "ab"}
    host_mask = np.zeros((1, p_max + 1), np.int64)
    one = pinned_empty(8).view(np.int64)
    one[0] = 1
    staging = pinned_empty(cap)
    for b in (*dev.values(), mask_dev):
        cuda.zero(b.ptr, b.nbytes)
    rng = np.random.default_rng(0)

    def write_present(n_positions: int) -> None:  # what the engine would write into the present buffer
        data = rng.standard_normal(rows * n_positions * hd).astype(np.float32).view(np.uint8)
        host[plan.present_buf][:data.size] = data
        staging[:data.size] = data
        cuda.htod(dev[plan.present_buf].ptr, staging[:data.size])
        cuda.synchronize()

    def run(ops: list[Copy2D | MaskSet | MaskFill]) -> None:
        for op in ops:
            apply_host(op, host, host_mask)
            if isinstance(op, Copy2D):
                cuda.copy_2d(dev[op.dst].ptr + op.dst_offset, op.dst_pitch, dev[op.src].ptr + op.src_offset,
                             op.src_pitch, op.width, op.height)
            elif isinstance(op, MaskSet):
                cuda.htod(mask_dev.ptr + 8 * op.index, one)
            else:
                m = pinned_empty((p_max + 1) * 8).view(np.int64)[None, :op.bucket + 1]
                m[...] = bucket_mask(op.valid, op.bucket)
                cuda.htod(mask_dev.ptr, m)
                cuda.synchronize()

    plan.past_buf = "a"  # start() reads the prefill output from b
    write_present(5)
    run(plan.start(5))
    for _ in range(30):  # crosses buckets 8, 16, 32
        write_present(plan.past_dim + 1)
        run(plan.advance())
    out = {k: pinned_empty(cap) for k in "ab"}
    out_mask = pinned_empty((p_max + 1) * 8)
    for k in "ab":
        cuda.dtoh(out[k], dev[k].ptr)
    cuda.dtoh(out_mask, mask_dev.ptr)
    cuda.synchronize()
    np.testing.assert_array_equal(out["a"], host["a"])  # the past the next step would read
    np.testing.assert_array_equal(out_mask.view(np.int64)[:plan.past_dim + 1], host_mask[0, :plan.past_dim + 1])
    for b in (*dev.values(), mask_dev):
        b.close()


def test_graph_replay_reads_current_pinned_input() -> None:
    from cosyedge_models.backends.cuda import DeviceBuffer, pinned_empty
    from cosyedge_models.backends.tensorrt.session import thread_cuda

    cuda = thread_cuda(0)
    n = 1 << 16
    src, mid = pinned_empty(n), DeviceBuffer(n)
    dst_dev, out = DeviceBuffer(n), pinned_empty(n)
    src[:] = 1
    cuda.graphs.begin(cuda.handle)
    cuda.htod(mid.ptr, src)
    cuda.dtod(dst_dev.ptr, mid.ptr, n)
    cuda.dtoh(out, dst_dev.ptr)
    graph = cuda.graphs.end(cuda.handle)
    for value in (7, 42):
        src[:] = value
        graph.launch(cuda.handle)
        cuda.synchronize()
        assert (out == value).all()
    graph.close()
    for b in (mid, dst_dev):
        b.close()


def test_each_thread_has_its_own_stream() -> None:
    """Eight threads copy at once and end at different times while the others
    still copy (the first thread to end used to abort the interpreter: pycuda
    calls abort() when a thread ends with a context on its stack); each keeps
    its own stream, pycuda's stack is empty between calls, and a buffer made
    on a thread that has ended is freed from another one."""
    import pycuda.driver as drv
    from cosyedge_models.backends.cuda import DeviceBuffer, pinned_empty
    from cosyedge_models.backends.tensorrt.session import thread_cuda

    handles: dict[int, int] = {}
    left: dict[int, DeviceBuffer] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            cuda = thread_cuda(0)
            buf, host, back = DeviceBuffer(4096), pinned_empty(4096), pinned_empty(4096)
            left[i] = DeviceBuffer(1 << 20)
            host[:] = i
            for _ in range(20 * i):  # thread 1 ends first, thread 8 last
                cuda.htod(buf.ptr, host)
                cuda.dtoh(back, buf.ptr)
            cuda.synchronize()
            assert (back == i).all()
            assert drv.Context.get_current() is None  # nothing left on pycuda's stack
            handles[i] = cuda.handle
            buf.close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert len(set(handles.values())) == 8
    for b in left.values():  # made on threads that have ended
        b.close()
    cuda = thread_cuda(0)  # and the main thread still works after them
    buf, host, back = DeviceBuffer(64), pinned_empty(64), pinned_empty(64)
    host[:] = 5
    cuda.htod(buf.ptr, host)
    cuda.dtoh(back, buf.ptr)
    cuda.synchronize()
    assert (back == 5).all()
    buf.close()
