"""The backend interface and the factory that picks an implementation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from models.errors import BundleError

BACKENDS = ("ort", "ort-cuda", "ort-trt", "trt")


class Session(Protocol):
    """One loaded stage graph. `run` is safe to call from the thread that owns
    the session; GPU sessions are created per worker thread."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run the graph; returns the requested outputs (all by default) as host arrays."""
        ...

    def memory_bytes(self) -> int:
        """Best-effort size of what this session holds (weights + arena)."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str

    def load(self, stage: str, path: Path, *, threads: int | None = None) -> Session: ...

    def describe(self) -> dict[str, str]:
        """Versions and devices, for logs, `doctor` and benchmark reports."""
        ...


def create_backend(name: str, *, device_id: int = 0) -> Backend:
    """`ort`: ONNX Runtime on the CPU; `ort-cuda` / `ort-trt`: ONNX Runtime with
    the CUDA / TensorRT execution provider; `trt`: TensorRT engines (.plan)."""
    if name == "ort":
        from models.backends.ort import OrtBackend

        return OrtBackend(providers=("CPUExecutionProvider",))
    if name == "ort-cuda":
        from models.backends.ort import OrtBackend

        return OrtBackend(providers=("CUDAExecutionProvider", "CPUExecutionProvider"), device_id=device_id)
    if name == "ort-trt":
        from models.backends.ort import OrtBackend

        return OrtBackend(
            providers=("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
            device_id=device_id,
        )
    if name == "trt":
        from models.backends.trt import TrtBackend

        return TrtBackend(device_id=device_id)
    raise BundleError(f"unknown backend {name!r}; allowed: {', '.join(BACKENDS)}")
