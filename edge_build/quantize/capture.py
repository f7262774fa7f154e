"""Recording what each stage graph sees: a backend wrapper whose sessions copy
their feeds, and a driver that runs the fp32 pipeline over texts."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from cosyedge_build.quantize.feed_files import DiskFeeds
from cosyedge_models.backends.base import Backend, DecodeLoop, HostDecodeLoop, Session
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.flow_cache import HostStepCache, StepCache, StepCacheSpec
from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer

log = logging.getLogger(__name__)

Feed = dict[str, np.ndarray]

# An offline (whole-utterance) estimator feed attends over all of its frames in
# each of the 56 blocks, and onnxruntime's calibration graph keeps every block's
# activations alive until the reductions it appends at the end of the graph run:
# one 20.8 s feed (1,040 frames) took the calibration session to 12.6 GB at full
# size, and the default calibration run was killed at 24 GB. Such feeds are cut to
# their first frames: full attention over fewer frames is an input of the same
# kind (a shorter utterance). Streaming feeds (50-frame windows over a cache) stay whole.
MAX_OFFLINE_ESTIMATOR_FRAMES = 300
_FRAME_AXIS_INPUTS = ("x", "mask", "mu", "cond")


def bounded_feed(stage: str, feed: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """`feed` as the calibration keeps it: an offline estimator feed longer than
    MAX_OFFLINE_ESTIMATOR_FRAMES cut to its first frames, anything else unchanged."""
    if stage != "flow_estimator" or "att_cache" not in feed or feed["att_cache"].shape[0] != 0:
        return feed
    if feed["x"].shape[2] <= MAX_OFFLINE_ESTIMATOR_FRAMES:
        return feed
    n = MAX_OFFLINE_ESTIMATOR_FRAMES
    return {k: (v[..., :n] if k in _FRAME_AXIS_INPUTS else v) for k, v in feed.items()}


@dataclass
class FeedStore:
    """Feeds per stage, at most `cap` each: every call is counted, and once the
    cap is reached a new feed replaces a random earlier one (reservoir
    sampling), so long decode loops do not crowd out short ones. With
    `directory` the kept feeds are written there and read back one at a time
    (`DiskFeeds`); without, they are held in memory."""

    cap: int
    seed: int = 0
    directory: Path | None = None
    feeds: dict[str, Sequence[Feed]] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def _kept(self, stage: str) -> Sequence[Feed]:
        if stage not in self.feeds:
            self.feeds[stage] = DiskFeeds(self.directory / stage) if self.directory is not None else []
        return self.feeds[stage]

    def add(self, stage: str, feed: Mapping[str, np.ndarray]) -> None:
        feed = bounded_feed(stage, feed)
        n = self.seen.get(stage, 0)
        self.seen[stage] = n + 1
        kept = self._kept(stage)
        slot = len(kept)
        if slot >= self.cap:
            j = int(self._rng.integers(n + 1))
            if j >= self.cap:
                return
            slot = j
        if isinstance(kept, DiskFeeds):
            kept.put(slot, feed)
            return
        assert isinstance(kept, list)
        copy = {k: np.array(v, copy=True) for k, v in feed.items()}
        if slot == len(kept):
            kept.append(copy)
        else:
            kept[slot] = copy

    def nbytes(self) -> int:
        """Bytes of the kept feeds (on disk or in memory)."""
        total = 0
        for kept in self.feeds.values():
            if isinstance(kept, DiskFeeds):
                total += kept.nbytes()
            else:
                total += sum(v.nbytes for f in kept for v in f.values())
        return total


class CapturingSession:
    def __init__(self, inner: Session, store: FeedStore) -> None:
        self._inner = inner
        self._store = store
        self.name = inner.name
        self.input_names = inner.input_names
        self.output_names = inner.output_names

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        self._store.add(self.name, inputs)
        return self._inner.run(inputs, outputs)

    def memory_bytes(self) -> int:
        return self._inner.memory_bytes()

    def close(self) -> None:
        self._inner.close()


class CapturingBackend:
    """Wraps a host backend (the cache stays on the host, so every decode step
    goes through `Session.run` and is seen)."""

    def __init__(self, inner: Backend, store: FeedStore) -> None:
        self._inner = inner
        self.store = store
        self.name = inner.name

    def load(self, stage: str, path: Path, *, threads: int | None = None) -> Session:
        return CapturingSession(self._inner.load(stage, path, threads=threads), self.store)

    def decode_loop(self, prefill: Session, decode: Session) -> DecodeLoop:
        return HostDecodeLoop(prefill, decode)

    def flow_cache(self, estimator: Session, spec: StepCacheSpec) -> StepCache:
        return HostStepCache(estimator, spec)

    def describe(self) -> dict[str, str]:
        return self._inner.describe()


def capture_feeds(bundle_dir: Path, texts: Sequence[str], cap_per_stage: int, seed: int = 0,
                  directory: Path | None = None, on_text: Callable[[int], None] | None = None,
                  backend: str = "ort") -> FeedStore:
    """Synthesize every text with the fp32 bundle (streaming and offline
    alternately, so both flow paths are seen) and keep the stage feeds (in
    `directory` when given; `on_text(i)` after text i, for progress). `backend`:
    "ort" (CPU) or "ort-cuda" (a full-size bundle's capture in seconds on a GPU)."""
    store = FeedStore(cap=cap_per_stage, seed=seed, directory=directory)
    bundle = load_bundle(bundle_dir, precision="fp32")
    # Serial stages: with overlap the LLM's and the flow's feeds would reach the
    # store's reservoir sampler in a thread-dependent order (irreproducible calibration).
    engine = CosyVoiceSynthesizer(bundle, CapturingBackend(create_backend(backend), store),
                             SynthesisSettings(overlap_stages=False))
    try:
        for i, text in enumerate(texts):
            request = SynthesisRequest(text=text, stream=i % 2 == 0, seed=seed + i)
            for _ in engine.synthesize(request):
                pass
            if on_text is not None:
                on_text(i)
    finally:
        engine.close()
    log.info("captured feeds: %s", {k: f"{len(v)}/{store.seen[k]}" for k, v in store.feeds.items()})
    return store
