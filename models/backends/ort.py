"""ONNX Runtime backend."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from models.backends.base import HostDecodeLoop, Session
from models.errors import BundleError, EngineError

log = logging.getLogger(__name__)


class OrtSession:
    def __init__(self, name: str, path: Path, providers: Sequence[str], device_id: int, threads: int | None) -> None:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        available = set(ort.get_available_providers())
        chosen: list[str | tuple[str, dict[str, str]]] = []
        for p in providers:
            if p not in available:
                continue
            if p in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
                chosen.append((p, {"device_id": str(device_id)}))
            else:
                chosen.append(p)
        if not chosen:
            raise BundleError(
                f"none of the ONNX Runtime providers {list(providers)} is available here "
                f"(available: {sorted(available)})"
            )
        try:
            self._sess = ort.InferenceSession(str(path), sess_options=opts, providers=chosen)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise BundleError(f"cannot load {path}: {exc}") from exc
        self.name = name
        self.path = path
        self.input_names = tuple(i.name for i in self._sess.get_inputs())
        self.output_names = tuple(o.name for o in self._sess.get_outputs())
        self.providers = tuple(self._sess.get_providers())

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        names = list(outputs) if outputs is not None else list(self.output_names)
        try:
            values = self._sess.run(names, dict(inputs))
        except Exception as exc:
            raise EngineError(f"{self.name}: onnxruntime failed: {exc}") from exc
        return dict(zip(names, values, strict=True))

    def memory_bytes(self) -> int:
        # Weights dominate; the arena is not exposed by onnxruntime's Python API.
        size = self.path.stat().st_size
        data = self.path.with_name(self.path.name + ".data")
        return size + (data.stat().st_size if data.exists() else 0)

    def close(self) -> None:
        del self._sess


class OrtBackend:
    def __init__(self, providers: Sequence[str], device_id: int = 0) -> None:
        self.providers = tuple(providers)
        self.device_id = device_id
        self.name = "ort" if self.providers == ("CPUExecutionProvider",) else "ort-" + self.providers[0].removesuffix(
            "ExecutionProvider").lower()

    def load(self, stage: str, path: Path, *, threads: int | None = None) -> OrtSession:
        if threads is None:
            env = os.environ.get("COSYEDGE_ORT_THREADS")
            threads = int(env) if env else None
        return OrtSession(stage, path, self.providers, self.device_id, threads)

    def decode_loop(self, prefill: Session, decode: Session) -> HostDecodeLoop:
        return HostDecodeLoop(prefill, decode)

    def describe(self) -> dict[str, str]:
        return {
            "backend": self.name,
            "onnxruntime": ort.__version__,
            "providers": ",".join(p for p in self.providers if p in ort.get_available_providers()),
            "device": ort.get_device(),
        }
