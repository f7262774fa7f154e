"""The one place that picks a backend implementation by name. Apart from
the interfaces (base.py), so the implementations can import those without
a cycle."""

from __future__ import annotations

from cosyedge_models.backends.base import BACKENDS, Backend
from cosyedge_models.errors import BundleError


def create_backend(name: str, *, device_id: int = 0, cpu_memory_arena: bool = False) -> Backend:
    """`ort`: ONNX Runtime on the CPU; `ort-cuda` / `ort-trt`: ONNX Runtime with
    the CUDA / TensorRT execution provider; `trt`: TensorRT engines (.plan).
    `cpu_memory_arena`: onnxruntime's CPU arena for host tensors (SynthesisSettings)."""
    if name == "ort":
        from cosyedge_models.backends.ort import OrtBackend

        return OrtBackend(providers=("CPUExecutionProvider",), cpu_memory_arena=cpu_memory_arena)
    if name == "ort-cuda":
        from cosyedge_models.backends.ort import OrtBackend

        return OrtBackend(providers=("CUDAExecutionProvider", "CPUExecutionProvider"), device_id=device_id,
                          cpu_memory_arena=cpu_memory_arena)
    if name == "ort-trt":
        from cosyedge_models.backends.ort import OrtBackend

        return OrtBackend(
            providers=("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
            device_id=device_id, cpu_memory_arena=cpu_memory_arena,
        )
    if name == "trt":
        from cosyedge_models.backends.tensorrt.backend import TrtBackend

        return TrtBackend(device_id=device_id)
    raise BundleError(f"unknown backend {name!r}; allowed: {', '.join(BACKENDS)}")
