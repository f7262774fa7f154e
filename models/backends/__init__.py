"""Inference backends: the same `Session` interface over ONNX Runtime (CPU,
CUDA or TensorRT execution providers) and native TensorRT engines. The
inference loop in `models` only ever talks to this interface."""

from __future__ import annotations

from cosyedge_models.backends.base import Backend, Session, create_backend

__all__ = ["Backend", "Session", "create_backend"]
