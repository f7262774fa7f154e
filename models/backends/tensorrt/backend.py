"""TensorRT backend: loads a bundle's `.plan` engines as sessions
(tensorrt/session.py), with the LLM decode loop (tensorrt/decode.py) and the flow
caches (tensorrt/flow_cache.py) on the device."""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from cosyedge_models.backends.cuda import device_info, driver
from cosyedge_models.backends.flow_cache import HostStepCache, StepCache, StepCacheSpec
from cosyedge_models.backends.gpu_probe import import_tensorrt
from cosyedge_models.backends.tensorrt.session import TrtSession, thread_cuda, trt_logger
from cosyedge_models.errors import BundleError, SynthesisError

if TYPE_CHECKING:
    import tensorrt as trt
    from cosyedge_models.backends.base import Session
    from cosyedge_models.backends.tensorrt.decode import TrtDecodeLoop


class TrtBackend:
    """`trt`: TensorRT engines (.plan files listed in the bundle's `engines`)."""

    name = "trt"

    def __init__(self, device_id: int = 0, *, decode_graphs: bool = True, device_flow_cache: bool = True) -> None:
        import_tensorrt()  # probes the GPU first; raises SynthesisError with the reason
        import tensorrt as trt

        self.device_id = device_id
        self.decode_graphs = decode_graphs
        self.device_flow_cache = device_flow_cache  # False: host flow caches (to compare)
        driver()
        thread_cuda(device_id)  # the loading thread needs a current context
        self._runtime = trt.Runtime(trt_logger())
        self._lock = threading.Lock()
        # one deserialized engine per plan file: llm_prefill and llm_decode recorded with one
        # plan (edge_build/tensorrt/engines.py) share one engine, so one copy of its weights
        self._engines: dict[Path, trt.ICudaEngine] = {}

    def load(self, stage: str, path: Path, *, threads: int | None = None) -> TrtSession:
        if path.suffix != ".plan":
            raise BundleError(f"{path}: the trt backend loads TensorRT .plan engines; build them with: "
                              f"cosyedge build engines --bundle {path.parent}")
        thread_cuda(self.device_id)
        key = path.resolve()
        with self._lock:
            engine = self._engines.get(key)
        if engine is not None:
            return self._session(stage, path, engine)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise BundleError(f"cannot read engine {path}: {exc}") from exc
        with self._lock:
            engine = self._engines.get(key) or self._runtime.deserialize_cuda_engine(data)
            if engine is not None:
                self._engines[key] = engine
        if engine is None:
            raise BundleError(f"{path}: TensorRT could not deserialize this engine (built by another TensorRT "
                              f"version or for another GPU?); rebuild with: cosyedge build engines --bundle "
                              f"{path.parent}")
        return self._session(stage, path, engine)

    def _session(self, stage: str, path: Path, engine: trt.ICudaEngine) -> TrtSession:
        session = TrtSession(stage, path, engine, self.device_id)
        if stage == "llm_prefill" and "past_kv" in session.input_names:
            # one LLM engine (llm_prefill recorded as llm_decode's plan): a plain prefill
            # (a voice's prefix, synthesis/llm_prefix.py) runs it over an empty past
            session.defaults["past_kv"] = functools.partial(empty_past, session)
        return session

    def decode_loop(self, prefill: Session, decode: Session) -> TrtDecodeLoop:
        from cosyedge_models.backends.tensorrt.decode import TrtDecodeLoop

        if not isinstance(prefill, TrtSession) or not isinstance(decode, TrtSession):
            raise SynthesisError("the trt decode loop needs sessions loaded by the trt backend")
        return TrtDecodeLoop(prefill, decode, use_graphs=self.decode_graphs)

    def flow_cache(self, estimator: Session, spec: StepCacheSpec) -> StepCache:
        # Device caches for the engine's own sessions (models/backends/tensorrt/flow_cache.py);
        # host arrays for anything else (a stage batcher's wrapper).
        if isinstance(estimator, TrtSession) and self.device_flow_cache:
            from cosyedge_models.backends.tensorrt.flow_cache import TrtStepCache

            return TrtStepCache(estimator, spec)
        return HostStepCache(estimator, spec)

    def describe(self) -> dict[str, str]:
        import tensorrt as trt

        info = device_info(self.device_id)
        return {"backend": self.name, "tensorrt": str(trt.__version__), "device": info.name,
                "compute_capability": info.compute_capability, "decode_graphs": str(self.decode_graphs)}


def empty_past(session: TrtSession, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """past_kv [L, 2, B, Hkv, 0, hd] for a prefill of `inputs` that starts from nothing."""
    spec = session.specs["past_kv"]
    layers, two, _, heads, _, head_dim = next(p["past_kv"].max for p in session.profiles if "past_kv" in p)
    batch = int(np.shape(inputs["inputs_embeds"])[0]) if "inputs_embeds" in inputs else 1
    return np.zeros((layers, two, batch, heads, 0, head_dim), dtype=spec.dtype)


def describe_engine(session: TrtSession) -> dict[str, Any]:
    """I/O names, dtypes and profile ranges of a loaded engine (for doctor/bench)."""
    return {
        "inputs": {n: str(session.specs[n].dtype) for n in session.input_names},
        "outputs": {n: str(session.specs[n].dtype) for n in session.output_names},
        "profiles": [{n: [list(r.min), list(r.opt), list(r.max)] for n, r in p.items()} for p in session.profiles],
        "device_memory_bytes": int(session.engine.device_memory_size_v2),
    }
