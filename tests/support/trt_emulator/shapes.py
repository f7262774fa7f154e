"""The engine's ONNX graph on onnxruntime (CPU): inference, and the output shapes TensorRT
computes from the input shapes before running (ExecutionContext.get_tensor_shape)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort


class EngineModel:
    """One onnxruntime session per engine (onnxruntime's run is thread-safe)."""

    def __init__(self, onnx_bytes: bytes) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(onnx_bytes, opts, providers=["CPUExecutionProvider"])
        self._inputs = {i.name: i for i in self.session.get_inputs()}
        self._outputs = [o.name for o in self.session.get_outputs()]
        self._cache: dict[tuple[tuple[str, tuple[int, ...]], ...], dict[str, tuple[int, ...]]] = {}
        self._lock = threading.Lock()
        self._trust_symbolic: bool | None = None  # None: not checked yet

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(v) for v in self.session.run(list(outputs), dict(feeds))]

    def output_shapes(self, inputs: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        key = tuple(sorted((k, tuple(v)) for k, v in inputs.items()))
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        shapes = self._symbolic(inputs) if self._trust_symbolic is not False else None
        if shapes is None or self._trust_symbolic is None:
            # GUESS (method): shapes the graph does not state symbolically come from a run on zeros; TensorRT
            # computes them without running (data-dependent shapes are not emulated)
            feeds = {n: np.zeros(inputs[n], _np_type(self._inputs[n].type)) for n in self._inputs}
            outs = self.session.run(self._outputs, feeds)
            ran = {n: tuple(int(d) for d in np.shape(v)) for n, v in zip(self._outputs, outs, strict=True)}
            if shapes is not None:
                # the first symbolic answer is checked against a run: an exporter may name an output
                # dimension after an input's while it differs (T vs T + 1)
                self._trust_symbolic = shapes == ran
            shapes = ran
        with self._lock:
            self._cache[key] = shapes
        return shapes

    def _symbolic(self, inputs: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]] | None:
        sym: dict[str, int] = {}
        for name, meta in self._inputs.items():
            for d, v in zip(meta.shape, inputs[name], strict=False):
                if isinstance(d, str) and sym.setdefault(d, int(v)) != int(v):
                    return None
        out = {}
        for o in self.session.get_outputs():
            dims = []
            for d in o.shape:
                if isinstance(d, int):
                    dims.append(d)
                elif isinstance(d, str) and d in sym:
                    dims.append(sym[d])
                else:
                    return None
            out[o.name] = tuple(dims)
        return out


_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


def _np_type(t: str) -> type:
    return _ORT_TYPES[t]
