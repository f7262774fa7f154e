"""Offline requests served as streams joined (`offline_as_stream`, on by default where the batched
flow lanes are loaded): the audio is the streamed request's, in one chunk, without first-audio holds
on the graph thread; `speed` other than 1.0 and the setting off keep the whole-utterance path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.offline import Pieces, joined
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer

TEXT = "An offline request that rides on the streams of the batched lanes."


def _chunks(eng: CosyVoiceSynthesizer, stream: bool, speed: float = 1.0) -> list[np.ndarray]:
    return [c.pcm for c in eng.synthesize(SynthesisRequest(text=TEXT, seed=11, stream=stream, speed=speed))]


def _holds(eng: CosyVoiceSynthesizer) -> int:
    return sum(int(stats["holds"]) for stats in eng.graphs.order_stats().values())  # type: ignore[call-overload]


def _settings(**kw: object) -> SynthesisSettings:
    return SynthesisSettings(backend="ort", threads=1, overlap_stages=False, graph_flow=True, graph_encoder=False,
                             graph_flow_batch=True, **kw)  # type: ignore[arg-type]


def test_an_offline_request_is_the_streamed_audio_in_one_chunk(static_flow_bundle: Path) -> None:
    eng = load_synthesizer(static_flow_bundle, "ort", _settings())
    try:
        assert eng.graphs.flow_batch is not None and eng.offline_as_stream  # auto: on with the lanes
        streamed = _chunks(eng, stream=True)
        holds = _holds(eng)
        assert len(streamed) > 2 and holds > 0  # a streamed request's first chunk held the graph thread
        (offline,) = _chunks(eng, stream=False)
        np.testing.assert_array_equal(offline, np.concatenate(streamed))
        assert _holds(eng) == holds  # no first audio to hurry: no hold
        (slow,) = _chunks(eng, stream=False, speed=0.5)  # speed: the whole-utterance path, resized
        assert abs(slow.size / offline.size - 2.0) < 0.2
    finally:
        eng.close()


def test_the_setting_off_keeps_the_whole_utterance_pass(static_flow_bundle: Path) -> None:
    on = load_synthesizer(static_flow_bundle, "ort", _settings())
    off = load_synthesizer(static_flow_bundle, "ort", _settings(offline_as_stream=False))
    try:
        assert not off.offline_as_stream
        (whole,) = _chunks(off, stream=False)
        (streamed,) = _chunks(on, stream=False)
        # the same tokens (one seeded sampler), another flow: one pass over the utterance, not chunks
        assert whole.size == streamed.size and not np.array_equal(whole, streamed)
    finally:
        on.close()
        off.close()


def _nothing() -> Pieces:
    yield from ()


def test_joined_closes_the_stream_and_joins_its_pieces() -> None:
    closed = []

    def pieces():  # type: ignore[no-untyped-def]
        try:
            yield np.ones(3, np.float32), False
            yield np.zeros(0, np.float32), False
            yield np.full(2, 2.0, np.float32), True
        finally:
            closed.append(True)

    ((pcm, final),) = list(joined(pieces()))
    assert final and closed == [True]
    np.testing.assert_array_equal(pcm, [1, 1, 1, 2, 2])
    ((empty, _),) = list(joined(_nothing()))
    assert empty.size == 0 and empty.dtype == np.float32
