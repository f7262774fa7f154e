"""TensorRT backend tests (`pytest -m gpu`) run only where a GPU, a real
TensorRT and pycuda exist. The check never imports tensorrt on a machine
without a GPU (that can segfault) and does not take the type-stub package
(an importable but empty `tensorrt`) for TensorRT. Elsewhere the tests are
skipped with the reason (pytest -ra prints it)."""

from __future__ import annotations

import importlib.util

import pytest


def trt_unavailable_reason() -> str | None:
    from models.backends.gpu_probe import probe_gpu, probe_tensorrt

    gpu = probe_gpu()
    if not gpu.available:
        return f"no GPU ({gpu.reason})"
    trt = probe_tensorrt()
    if not trt.available:
        return f"no TensorRT ({trt.reason})"
    if importlib.util.find_spec("pycuda") is None:
        return "pycuda is not installed (pip install pycuda==2025.1.2 on the GPU machine)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    trt_items = [i for i in items if i.get_closest_marker("gpu") and "trt" in i.nodeid]
    if not trt_items:
        return
    reason = trt_unavailable_reason()
    if reason:
        skip = pytest.mark.skip(reason=f"TensorRT backend tests need a GPU with TensorRT: {reason}")
        for item in trt_items:
            item.add_marker(skip)
