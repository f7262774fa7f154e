"""models/backends/shape_pinned.py on the tiny bundle's HiFT decoder (real
onnxruntime sessions): each recurring input shape stays on its own session,
outputs equal one plain session's, the least recently used session is
reused beyond the cap, and the engine's audio does not change with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.shape_pinned import ShapePinnedSession
from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer

from tests.conftest import STATIC_VOCODER_FIRST_HOP, STATIC_VOCODER_LATER_HOP


class ShapeLog:
    """Wraps a real session and records the input shapes it ran."""

    def __init__(self, inner: Session) -> None:
        self.inner = inner
        self.name, self.input_names, self.output_names = inner.name, inner.input_names, inner.output_names
        self.shapes: list[int] = []

    def run(self, inputs, outputs=None):  # type: ignore[no-untyped-def]
        self.shapes.append(int(inputs["mel"].shape[2]))
        return self.inner.run(inputs, outputs)

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()

    def close(self) -> None:
        self.inner.close()


def _feeds(frames: int, upsample: int, mel_bins: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"mel": rng.standard_normal((1, mel_bins, frames)).astype(np.float32),
            "source": (0.1 * rng.standard_normal((1, 1, frames * upsample))).astype(np.float32)}


def test_each_shape_keeps_its_session(tiny_bundle: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    backend = create_backend("ort")
    path = bundle.stages["hift_decoder"].path
    made: list[ShapeLog] = []

    def load() -> Session:
        made.append(ShapeLog(backend.load("hift_decoder", path, threads=1)))
        return made[-1]

    pinned = ShapePinnedSession(load, max_sessions=2)
    plain = backend.load("hift_decoder", path, threads=1)
    up = bundle.hift.upsample_factor
    try:
        for i, frames in enumerate([20, 28, 28, 20, 28, 20]):
            feeds = _feeds(frames, up, bundle.mel_bins, i)
            np.testing.assert_array_equal(pinned.run(feeds)["audio"], plain.run(feeds)["audio"])
        assert pinned.loads == 2 and sorted(set(s.shapes[0] for s in made)) == [20, 28]
        assert all(len(set(s.shapes)) == 1 for s in made)  # no session ever changed shape
        pinned.run(_feeds(33, up, bundle.mel_bins, 9))  # a third shape: the least recently used one moves
        assert pinned.loads == 2 and made[1].shapes[-1] == 33 and set(made[0].shapes) == {20}  # 28 was LRU
    finally:
        pinned.close()
        plain.close()


def test_engine_audio_is_unchanged_with_pinned_vocoder_sessions(tiny_bundle: Path) -> None:
    req = SynthesisRequest(text="Hello from the tiny model, one two three.", seed=3, stream=True)
    out = {}
    for n in (1, 3):
        eng = load_synthesizer(tiny_bundle, "ort",
                               SynthesisSettings(backend="ort", vocoder_sessions=n, overlap_stages=False))
        try:
            assert isinstance(eng.vocoder.decoder_session, ShapePinnedSession) == (n > 1)
            out[n] = np.concatenate([c.pcm for c in eng.synthesize(req)])
        finally:
            eng.close()
    np.testing.assert_array_equal(out[1], out[3])


def test_the_recurring_chunk_shapes_are_set_up_at_load(tiny_bundle: Path) -> None:
    """With pinned sessions the engine runs the vocoder once at the first and the
    steady chunk's mel lengths at load, so a stream's first chunk meets a
    session already on its shape (150-200 ms on the H200 otherwise)."""
    eng = load_synthesizer(tiny_bundle, "ort", SynthesisSettings(backend="ort", vocoder_sessions=3,
                                                                 overlap_stages=False))
    try:
        decoder = eng.vocoder.decoder_session
        assert isinstance(decoder, ShapePinnedSession)
        warmed = {key[0][2] for key in decoder.pinned_shapes()}  # (mel, source) shapes: mel frames
        hop, ratio = eng.bundle.streaming.token_hop_len, eng.bundle.token_mel_ratio
        assert decoder.loads == 2 and warmed == {hop * ratio, hop * ratio + eng.bundle.streaming.mel_cache_len}
        seen: list[int] = []
        run = decoder.run

        def recording(inputs, outputs=None):  # type: ignore[no-untyped-def]
            seen.append(int(inputs["mel"].shape[2]))
            return run(inputs, outputs)

        decoder.run = recording  # type: ignore[method-assign]
        text = "Hello from the tiny model, one two three, and a few more words to make chunks."
        chunks = list(eng.synthesize(SynthesisRequest(text=text, seed=3, stream=True)))
        assert len(chunks) >= 3 and len(seen) == len(chunks)
        assert set(seen[:-1]) <= warmed  # every chunk but the last (any length) had its session ready
    finally:
        eng.close()


def test_a_first_hop_the_fixed_length_graphs_lack_is_set_up_on_the_dynamic_vocoder(graph_bundle: Path) -> None:
    """The fixed-length vocoder graphs serve the bundle's default chunk lengths (and graph_bundle's
    exported first hop), so nothing is set up at load; a first hop of 10 tokens makes a first
    chunk none of them has, and warm_vocoder() (at load with that setting, or bench after changing
    it) sets up that length alone (likely what the H200's 15-token first chunk paid on its first
    request, docs/gpu.md)."""
    eng = load_synthesizer(graph_bundle, "ort", SynthesisSettings(backend="ort", vocoder_sessions=3,
                                                                  graph_vocoder=True, overlap_stages=False))
    try:
        decoder = eng.vocoder.decoder_session
        assert isinstance(decoder, ShapePinnedSession) and eng.static_vocoder is not None
        ratio = eng.bundle.token_mel_ratio
        assert decoder.pinned_shapes() == [] and eng.warm_vocoder() == []
        eng.settings = dataclasses.replace(eng.settings, first_hop_tokens=STATIC_VOCODER_FIRST_HOP)
        assert eng.warm_vocoder() == []  # exported with the bundle: its fixed-length graph serves it
        eng.settings = dataclasses.replace(eng.settings, first_hop_tokens=10)
        assert 10 * ratio not in eng.static_vocoder.frames
        assert eng.warm_vocoder() == [10 * ratio]
        assert {key[0][2] for key in decoder.pinned_shapes()} == {10 * ratio}
        # a growing hop: its exported later hop's chunks have their graphs; one capped at 75, a steady chunk
        # of 75 x 2 + 8 frames and an offline request's first chunk of 75 x 2 that none has (the 50-token
        # chunk on its way there has one)
        eng.settings = dataclasses.replace(eng.settings, first_hop_tokens=None, hop_scale=2.0,
                                           max_hop_tokens=STATIC_VOCODER_LATER_HOP)
        assert eng.warm_vocoder() == []
        eng.settings = dataclasses.replace(eng.settings, max_hop_tokens=75)
        assert eng.warm_vocoder() == [75 * ratio + eng.bundle.streaming.mel_cache_len, 75 * ratio]
    finally:
        eng.close()
    eng = load_synthesizer(graph_bundle, "ort", SynthesisSettings(backend="ort", vocoder_sessions=3, graph_vocoder=True,
                                                                  overlap_stages=False, first_hop_tokens=10))
    try:  # the same at load
        decoder = eng.vocoder.decoder_session
        assert isinstance(decoder, ShapePinnedSession)
        assert {key[0][2] for key in decoder.pinned_shapes()} == {10 * eng.bundle.token_mel_ratio}
    finally:
        eng.close()
