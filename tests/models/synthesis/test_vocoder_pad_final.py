"""A stream's last chunk right-padded into a fixed-length vocoder graph (`vocoder_pad_final`, auto on
for ort-cuda, where a dynamic call at a new length costs 150-200 ms a graph): every earlier chunk
unchanged, the last one as long as before and equal up to where the padding reaches (HiFT's
convolutions are not causal), the fixed-length graph serving it; a last chunk longer than every
graph stays on the dynamic sessions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer

SHORT_LAST = "Hello from the tiny model, one two three, and a few more words."  # a last chunk of 20 frames
LONG_LAST = "Another sentence that runs on for a while with many words in it to make chunks."  # 58 frames


def _stream(bundle: Path, text: str, pad: bool | None) -> tuple[list[np.ndarray], int, bool]:
    eng = load_synthesizer(bundle, settings=SynthesisSettings(backend="ort", graph_vocoder=True, overlap_stages=False,
                                                              vocoder_pad_final=pad))
    try:
        chunks = [c.pcm for c in eng.synthesize(SynthesisRequest(text=text, seed=3, stream=True))]
        assert eng.static_vocoder is not None
        return chunks, eng.static_vocoder.replays, eng.vocoder.pad_final
    finally:
        eng.close()


def test_the_last_chunk_runs_padded_in_a_fixed_length_graph(graph_bundle: Path) -> None:
    exact, replays, pad = _stream(graph_bundle, SHORT_LAST, None)
    assert not pad  # auto: off on the CPU, where a new length costs nothing to set up
    padded, padded_replays, pad = _stream(graph_bundle, SHORT_LAST, True)
    assert pad and padded_replays == replays + 1  # the last chunk in a graph too
    assert len(padded) == len(exact) >= 3
    for a, b in zip(exact[:-1], padded[:-1], strict=True):
        np.testing.assert_array_equal(a, b)
    last, last_padded = exact[-1], padded[-1]
    assert last.size == last_padded.size
    diff = np.flatnonzero(np.abs(last - last_padded) > 1e-5)
    # the padding reaches back from the end only (~0.17 s on the tiny model), the rest is the same
    assert diff.size and diff[0] > last.size // 2
    np.testing.assert_allclose(last[: diff[0]], last_padded[: diff[0]], atol=1e-5)
    snr = 10 * np.log10(np.sum(last.astype(np.float64) ** 2) / np.sum((last - last_padded).astype(np.float64) ** 2))
    assert snr > 15.0, snr


def test_a_last_chunk_as_long_as_a_graph_is_not_padded(graph_bundle: Path) -> None:
    exact, replays, _ = _stream(graph_bundle, LONG_LAST, False)
    padded, padded_replays, _ = _stream(graph_bundle, LONG_LAST, True)
    assert padded_replays == replays  # it had its graph already: nothing to pad
    for a, b in zip(exact, padded, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_chunk_longer_than_every_graph_has_no_padded_run(graph_bundle: Path) -> None:
    eng = load_synthesizer(graph_bundle, settings=SynthesisSettings(backend="ort", graph_vocoder=True,
                                                                    vocoder_pad_final=True))
    try:
        v = eng.vocoder
        assert eng.static_vocoder is not None
        longest = max(eng.static_vocoder.frames)
        for frames, fits in ((longest + 1, False), (longest - 3, True)):
            mel = np.zeros((1, v.mel_bins, frames), np.float32)
            draws = np.zeros((1, frames * v.upsample, v.harmonics), np.float32)
            out = v.padded_run(mel, draws, None)
            assert (out is not None) is fits
            if out is not None:
                assert out[0].shape == (1, frames * v.upsample) and out[1].shape == (1, 1, frames * v.upsample)
    finally:
        eng.close()
