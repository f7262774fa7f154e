"""The backend interface and the factory that picks an implementation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from cosyedge_models.backends.flow_cache import StepCache, StepCacheSpec

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


class DecodeLoop(Protocol):
    """The LLM's prefill + decode steps for one request, with the KV cache kept
    where the backend computes (host memory for ONNX Runtime on the CPU, device
    memory for CUDA/TensorRT) so that no cache crosses to the host per token.
    Only the log-probabilities come back (the sampler runs on the CPU).

    `takes_past`: whether `prefill` can start from a saved cache (a voice's
    LLM prefix, models/synthesis/llm_prefix.py); a loop that cannot is given
    the whole prompt instead (same tokens)."""

    takes_past: bool

    def prefill(self, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        """inputs_embeds [1, T, D] -> logp [1, V]; starts a new cache, empty or
        (only where `takes_past`) a copy of `past` [L, 2, 1, Hkv, P, hd], a
        host array that stays unchanged, followed by the T positions."""
        ...

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        """inputs_embeds [1, 1, D] -> logp [1, V]; appends one position to the cache."""
        ...

    @property
    def cache_len(self) -> int: ...

    def close(self) -> None: ...


class FixedSizeDecode(Protocol):
    """Decode loops over a fixed-size cache (models/backends/ort_graph_decode.py),
    handed out while they last."""

    positions: int

    def loop(self, positions: int) -> DecodeLoop | None:
        """A loop for a request of at most `positions`, or None (use the backend's ordinary loop)."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str

    def load(self, stage: str, path: Path, *, threads: int | None = None) -> Session: ...

    def decode_loop(self, prefill: Session, decode: Session) -> DecodeLoop:
        """A per-request decode loop over two sessions this backend loaded."""
        ...

    def flow_cache(self, estimator: Session, spec: StepCacheSpec) -> StepCache:
        """One streaming request's estimator caches for one Euler step, kept
        where this backend computes (host arrays, or device memory bound to
        the estimator without a copy per call)."""
        ...

    def describe(self) -> dict[str, str]:
        """Versions and devices, for logs, `doctor` and benchmark reports."""
        ...


class HostDecodeLoop:
    """DecodeLoop over plain `Session.run` calls: the cache is a host array
    (right for ONNX Runtime on the CPU, where host memory is the device)."""

    takes_past = True  # with a bundle whose llm_decode takes T new positions (Bundle.llm_decode_positions)

    def __init__(self, prefill: Session, decode: Session) -> None:
        self._prefill = prefill
        self._decode = decode
        self._kv: np.ndarray | None = None

    def prefill(self, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        if past is None:
            mask = np.ones(inputs_embeds.shape[:2], dtype=np.int64)
            out = self._prefill.run({"inputs_embeds": inputs_embeds, "attention_mask": mask})
        else:  # the graph appends to its own output; the saved prefix is only read
            mask = np.ones((inputs_embeds.shape[0], past.shape[4] + inputs_embeds.shape[1]), dtype=np.int64)
            out = self._decode.run({"inputs_embeds": inputs_embeds, "attention_mask": mask, "past_kv": past})
        self._kv = out["present_kv"]
        return out["logp"]

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        if self._kv is None:
            raise RuntimeError("step() before prefill()")
        mask = np.ones((inputs_embeds.shape[0], self._kv.shape[4] + 1), dtype=np.int64)
        out = self._decode.run({"inputs_embeds": inputs_embeds, "attention_mask": mask, "past_kv": self._kv})
        self._kv = out["present_kv"]
        return out["logp"]

    @property
    def cache_len(self) -> int:
        return 0 if self._kv is None else int(self._kv.shape[4])

    def close(self) -> None:
        self._kv = None
