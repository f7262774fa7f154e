"""Helpers the fixed-shape flow tests share: the ort sessions a test needs, a cache
factory that keeps what it made, and one streaming pass through a FlowDecoder as the
engine drives it (hops of the chunk schedule, then finish)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.ort import OrtBackend, OrtSession
from cosyedge_models.bundle.loader import Bundle, load_bundle
from cosyedge_models.synthesis.flow import FlowDecoder, FlowPrompt
from cosyedge_models.synthesis.streaming import ChunkSchedule
from cosyedge_models.synthesis.voice_cache import FlowPrefix

MadeT = TypeVar("MadeT")


class Recording(Generic[MadeT]):
    """A cache factory (step or encoder caches) that keeps what it made."""

    def __init__(self, inner: Callable[[Session, Any], MadeT]) -> None:
        self.inner = inner
        self.made: list[MadeT] = []

    def __call__(self, session: Session, spec: Any) -> MadeT:
        cache = self.inner(session, spec)
        self.made.append(cache)
        return cache


def flow_sessions(bundle_dir: Path, device: str, prefix: str) -> tuple[dict[str, OrtSession], Bundle]:
    """The dynamic flow graphs and the bundle's fixed-shape graphs named `prefix`..., on `device`."""
    bundle = load_bundle(bundle_dir)
    backend = create_backend("ort" if device == "cpu" else "ort-cuda")
    assert isinstance(backend, OrtBackend)
    names = ["flow_encoder", "flow_estimator", *[n for n in bundle.stages if n.startswith(prefix)]]
    return {n: backend.load(n, bundle.stages[n].path, threads=1) for n in names}, bundle


def stream_mel(decoder: FlowDecoder, prompt: FlowPrompt, toks: np.ndarray, left: int = -1,
               prefix: FlowPrefix | None = None, hop: int = 25) -> np.ndarray:
    """The mel of one cached streaming pass over `toks` (look-ahead as the engine sends it)."""
    look = decoder.config.pre_lookahead_len
    schedule = ChunkSchedule(hop, look, prompt_tokens=len(prompt.tokens))
    mels = []
    with decoder.stream(prompt, "cached", left, prefix=prefix) as stream:
        while (chunk := schedule.next_chunk(len(toks))) is not None:
            mels.append(stream.push(toks[: chunk.end + look]))
        mels.append(stream.finish(toks))
    return np.concatenate(mels, axis=2)
