"""The one place that picks a backend implementation by name. Apart from
the interfaces (base.py), so the implementations can import those without
a cycle."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cosyedge_models.backends.base import BACKENDS, Backend
from cosyedge_models.errors import BundleError

if TYPE_CHECKING:
    from cosyedge_models.bundle.loader import Bundle


def create_backend(name: str, *, device_id: int = 0, cpu_memory_arena: bool = False,
                   bundle: Bundle | None = None) -> Backend:
    """`ort`: ONNX Runtime on the CPU; `ort-cuda` / `ort-trt`: ONNX Runtime with
    the CUDA / TensorRT execution provider; `trt`: TensorRT engines (.plan).
    `cpu_memory_arena`: onnxruntime's CPU arena for host tensors (SynthesisSettings).
    `bundle`: the bundle the backend will run (ort-trt makes its provider's options from it)."""
    if name == "ort":
        from cosyedge_models.backends.ort import OrtBackend

        return OrtBackend(providers=("CPUExecutionProvider",), cpu_memory_arena=cpu_memory_arena)
    if name == "ort-cuda":
        from cosyedge_models.backends.ort import OrtBackend

        return OrtBackend(providers=("CUDAExecutionProvider", "CPUExecutionProvider"), device_id=device_id,
                          cpu_memory_arena=cpu_memory_arena)
    if name == "ort-trt":
        import onnxruntime as ort
        from cosyedge_models.backends import ort_trt
        from cosyedge_models.backends.ort import OrtBackend

        ort_trt.require_provider(ort.get_available_providers())
        if bundle is None:
            raise ValueError("backend ort-trt is made for a bundle (create_backend(..., bundle=...))")
        stages = {n: ort_trt.StageOptions(n, s.precision, s.raw) for n, s in bundle.stages.items()}
        return OrtBackend(
            providers=(ort_trt.PROVIDER, "CUDAExecutionProvider", "CPUExecutionProvider"),
            device_id=device_id, cpu_memory_arena=cpu_memory_arena,
            trt_stages=ort_trt.TrtStages(bundle.root, stages),
        )
    if name == "trt":
        from cosyedge_models.backends.tensorrt.backend import TrtBackend

        return TrtBackend(device_id=device_id)
    raise BundleError(f"unknown backend {name!r}; allowed: {', '.join(BACKENDS)}")
