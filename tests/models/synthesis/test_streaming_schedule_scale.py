"""models/streaming.ChunkSchedule with a growing hop (upstream's stream_scale_factor)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.streaming import ChunkSchedule, check_hops, grown_hops, stream_mel_frames
from cosyedge_models.synthesis.synthesizer import load_synthesizer
from cosyedge_models.tools.first_chunk_bench import stream_chunks
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import STATIC_FLOW_WINDOWS


def _chunks(schedule: ChunkSchedule, n_tokens: int) -> list[tuple[int, int]]:
    out = []
    for n in range(n_tokens + 1):
        while (c := schedule.next_chunk(n)) is not None:
            out.append((c.start, c.end))
    return out


def test_hop_doubles_up_to_four_times_and_stays_aligned() -> None:
    s = ChunkSchedule(hop=25, lookahead=3, prompt_tokens=40, hop_scale=2.0)
    chunks = _chunks(s, 600)
    sizes = [end - start for start, end in chunks]
    assert sizes[:5] == [35, 50, 100, 100, 100]  # first hop aligned to the prompt: 40 + 35 = 75
    assert all((40 + end) % 25 == 0 for _, end in chunks)  # every chunk ends on a flow mask chunk
    assert chunks[0][0] == 0 and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    assert s.final_chunk(600).start == chunks[-1][1]


def test_fixed_hop_by_default_and_custom_cap() -> None:
    assert [e - b for b, e in _chunks(ChunkSchedule(hop=25, lookahead=3), 200)] == [25] * 7
    sizes = [e - b for b, e in _chunks(ChunkSchedule(hop=10, lookahead=0, hop_scale=1.5, max_hop=20), 120)]
    assert sizes[:4] == [10, 15, 20, 20] and max(sizes) == 20
    with pytest.raises(ValueError, match="hop_scale must be >= 1.0"):
        ChunkSchedule(hop=25, lookahead=3, hop_scale=0.5)
    with pytest.raises(ValueError, match="max_hop must be >= hop"):
        ChunkSchedule(hop=25, lookahead=3, max_hop=10)


def test_engine_streams_with_growing_hop(tiny_bundle: object) -> None:
    text = "The kiosk greets every visitor and explains the opening hours of the museum."
    counts, lengths = [], []
    for scale in (1.0, 2.0):
        engine = load_synthesizer(tiny_bundle, settings=SynthesisSettings(hop_scale=scale))  # type: ignore[arg-type]
        try:
            chunks = list(engine.synthesize(SynthesisRequest(text=text, stream=True, seed=3)))
        finally:
            engine.close()
        pcm = np.concatenate([c.pcm for c in chunks])
        assert np.isfinite(pcm).all() and chunks[-1].last
        counts.append(len(chunks))
        lengths.append(pcm.size)
    assert lengths[0] == lengths[1]  # same tokens (same seed), same audio length
    assert counts[1] < counts[0], counts


@pytest.mark.parametrize(("first_hop", "prompt_tokens"), [(None, 0), (None, 10), (15, 10), (7, 0)])
def test_first_chunk_tokens_is_where_the_first_chunk_becomes_ready(first_hop: int | None, prompt_tokens: int) -> None:
    schedule = ChunkSchedule(25, 3, prompt_tokens=prompt_tokens, first_hop=first_hop)
    need = schedule.first_chunk_tokens()
    assert need == (first_hop if first_hop is not None else 25 + (-prompt_tokens % 25)) + 3
    assert schedule.next_chunk(need - 1) is None
    chunk = schedule.next_chunk(need)
    assert chunk is not None and chunk.start == 0 and chunk.end == need - 3


def _later_sizes(schedule: ChunkSchedule, n_tokens: int) -> list[int]:
    return [end - start for start, end in _chunks(schedule, n_tokens)[1:]]


@settings(max_examples=200, deadline=None)
@given(hop=st.integers(1, 40), scale=st.floats(1.0, 4.0), cap_over=st.one_of(st.none(), st.integers(0, 120)))
def test_grown_hops_are_the_schedule_s_later_hops(hop: int, scale: float, cap_over: int | None) -> None:
    cap = None if cap_over is None else hop + cap_over
    hops = grown_hops(hop, scale, cap)
    sizes = _later_sizes(ChunkSchedule(hop, 3, hop_scale=scale, max_hop=cap), 40 * (cap or 4 * hop))
    # ChunkSchedule grows the hop after the first chunk too: its later chunks take the grown hops
    # (the first of them, the hop itself, only when the factor cannot grow it) and then the last for good
    grown = hops[1:] or hops
    assert sizes[:len(grown)] == grown and set(sizes) == set(grown)
    assert hops == sorted(set(hops)) and hops[0] == hop and hops[-1] <= (cap if cap is not None else 4 * hop)


def test_grown_hops_and_the_vocoder_lengths_they_repeat() -> None:
    assert grown_hops(25, 1.0) == [25]
    assert grown_hops(25, 2.0) == [25, 50, 100]  # upstream's cap: 4 x the hop
    assert grown_hops(25, 2.0, 50) == [25, 50]
    assert grown_hops(10, 1.5, 20) == [10, 15, 20]
    # hop 25 at 2 mel frames a token with 8 kept frames: the first chunk 50, the steady 58, and 50 tokens' 108
    assert stream_mel_frames(25, 2, 8) == [50, 58]
    # ... and with the hop growing, an offline request's first chunk at the grown hop: 50 x 2 = 100
    assert stream_mel_frames(25, 2, 8, hop_scale=2.0, max_hop=50) == [50, 58, 108, 100]
    assert stream_mel_frames(25, 2, 8, first_hop=15, hop_scale=2.0, max_hop=50) == [30, 58, 108, 100]
    assert stream_mel_frames(25, 2, 8, hop_scale=2.0) == [50, 58, 108, 208, 200]


@pytest.mark.parametrize(("prompt_tokens", "first"), [(0, 50), (10, 40), (24, 26), (25, 50), (49, 26)])
def test_an_offline_schedule_starts_at_the_grown_hop_on_a_whole_chunk(prompt_tokens: int, first: int) -> None:
    """grown_start (an offline request served as a stream): the first chunk is the largest hop up to the
    grown one whose end, after the prompt, is a whole chunk of the hop; every later chunk the grown hop.
    A first hop set for first audio does not apply; a fixed hop keeps the streaming schedule."""
    s = ChunkSchedule(25, 3, prompt_tokens=prompt_tokens, first_hop=15, hop_scale=2.0, max_hop=50, grown_start=True)
    assert s.first_chunk_tokens() == first + 3
    sizes = [end - start for start, end in _chunks(s, 400)]
    assert sizes[0] == first and set(sizes[1:]) == {50} and (prompt_tokens + first) % 25 == 0
    fixed = ChunkSchedule(25, 3, prompt_tokens=prompt_tokens, grown_start=True)
    assert _chunks(fixed, 200) == _chunks(ChunkSchedule(25, 3, prompt_tokens=prompt_tokens), 200)


def test_the_cap_is_checked_against_the_bundle_and_its_windows(static_flow_bundle: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The tiny bundle: hop 25, 2 mel frames a token, 3 look-ahead tokens, fixed-shape windows up to 160
    frames: chunks of 75 tokens need (75 + 3) x 2 = 156 frames and fit, upstream's cap (100: 206) does not."""
    bundle = load_bundle(static_flow_bundle)
    assert max(STATIC_FLOW_WINDOWS) == 160 and bundle.flow.pre_lookahead_len == 3
    with pytest.raises(ValueError, match="max_hop_tokens must be at least the bundle's hop of 25 speech tokens"):
        check_hops(bundle, None, 2.0, 20)
    with caplog.at_level(logging.WARNING, logger="cosyedge_models.synthesis.streaming"):
        check_hops(bundle, None, 2.0, None)
        assert "206 frames" in caplog.text and "max_hop_tokens 75 would keep them there" in caplog.text
        caplog.clear()
        check_hops(bundle, None, 2.0, 75)
        check_hops(bundle, None, 1.0, None)  # a fixed hop never grows past the windows
        assert caplog.text == ""


def _lanes(**kw: object) -> SynthesisSettings:
    base: dict[str, object] = dict(backend="ort", threads=1, overlap_stages=False, graph_flow=True,
                                   graph_encoder=False, graph_flow_batch=True, graph_flow_overflow_slots=0,
                                   hop_scale=4.0)
    return SynthesisSettings(**{**base, **kw})  # type: ignore[arg-type]


def test_a_cap_that_fits_keeps_the_grown_chunks_on_the_lanes(static_flow_bundle: Path) -> None:
    """On the batched lanes (the GPU's path; no capture on the CPU), 110 speech tokens with the hop growing
    fourfold: capped at 50 the chunks are 25, 50 and the last 35 tokens (windows of 56, 106 and 70 frames,
    150 committed: all within the tiny bundle's 160-frame windows and cache), and the mel is the dynamic
    estimator's for the same chunks; upstream's cap (100) makes the second chunk the last 85 tokens, 170
    frames, which moves the stream to the dynamic graph."""
    tokens = np.random.default_rng(7).integers(0, 64, 110).astype(np.int64)
    mels, stats = {}, {}
    for name, kw in (("fits", dict(max_hop_tokens=50)), ("upstream", {}),
                     ("dynamic", dict(max_hop_tokens=50, graph_flow=False, graph_flow_batch=False))):
        eng = load_synthesizer(static_flow_bundle, "ort", _lanes(**kw))
        try:
            prompt = eng.conditioning.build(SynthesisRequest(text="a prompt-less voice", stream=True)).flow
            assert len(prompt.tokens) == 0
            mels[name] = stream_chunks(eng, prompt, tokens, None, None)[0]
            stats[name] = eng.graphs.flow_batch_stats()
        finally:
            eng.close()
    fits, upstream = stats["fits"], stats["upstream"]
    assert fits is not None and upstream is not None
    # 10 Euler steps a chunk; the windows of 56, 106 and 70 frames in the buckets of 64, 160 and 160
    assert fits["moves"] == 0 and fits["windows"] == {64: 10, 160: 20}
    assert upstream["moves"] == 10  # every Euler step's cache, at the second chunk
    assert [m.shape[2] for m in mels["fits"]] == [50, 100, 70]
    for a, b in zip(mels["fits"], mels["dynamic"], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * float(np.abs(b).max()))


def test_the_engine_refuses_a_cap_below_the_hop(tiny_bundle: Path) -> None:
    with pytest.raises(ValueError, match=r"max_hop_tokens must be >= 1 or None \(4 x the hop\), got 0"):
        SynthesisSettings(max_hop_tokens=0)
    with pytest.raises(ValueError, match="must be at least the bundle's hop of 25 speech tokens, got 24"):
        load_synthesizer(tiny_bundle, settings=SynthesisSettings(hop_scale=2.0, max_hop_tokens=24))


def _windows(n_tokens: int, grown_start: bool) -> dict[int, int]:
    """The tiny lanes' replays by window (64 or 160 frames) for `n_tokens` at hop 25 growing to 50."""
    schedule = ChunkSchedule(25, 3, hop_scale=2.0, max_hop=50, grown_start=grown_start)
    frames = [(c.end - c.start + 3) * 2 for c in iter(lambda: schedule.next_chunk(n_tokens), None)]
    final = schedule.final_chunk(n_tokens)
    out: dict[int, int] = {}
    for f in [*frames, (final.end - final.start) * 2]:
        out[64 if f <= 64 else 160] = out.get(64 if f <= 64 else 160, 0) + 10  # ten Euler steps a chunk
    return out


def test_an_offline_request_on_the_lanes_takes_the_grown_hop_from_its_first_chunk(static_flow_bundle: Path) -> None:
    """Served as a stream (offline_as_stream), an offline request with the hop growing to 50 runs its first
    chunk at 50 tokens too (ChunkSchedule.grown_start), with no move off the lanes, and its audio is the
    dynamic estimator's for the same chunks; a streamed request keeps its 25-token first chunk."""
    request = SynthesisRequest(text="The shop opens at nine.", seed=0, stream=False)
    audio, windows = {}, {}
    for name, kw in (("lanes", {}), ("dynamic", dict(graph_flow=False, graph_flow_batch=False))):
        eng = load_synthesizer(static_flow_bundle, "ort", _lanes(**kw, offline_as_stream=True, max_hop_tokens=50))
        try:
            (audio[name],) = [c.pcm for c in eng.synthesize(request)]
            stats = eng.graphs.flow_batch_stats()
            if stats is not None:
                assert stats["moves"] == 0
                windows["offline"] = dict(stats["windows"])  # type: ignore[call-overload]
                streamed = [c.pcm for c in eng.synthesize(dataclasses.replace(request, stream=True))]
                after = dict(eng.graphs.flow_batch_stats()["windows"])  # type: ignore[index, call-overload]
                windows["streamed"] = {w: n - windows["offline"].get(w, 0) for w, n in after.items()}
        finally:
            eng.close()
    n_tokens = audio["lanes"].size // 960  # 2 mel frames a token, 480 samples a frame
    assert _windows(n_tokens, True) != _windows(n_tokens, False)  # this request tells the schedules apart
    assert windows["offline"] == _windows(n_tokens, True)
    assert {w: n for w, n in windows["streamed"].items() if n} == _windows(n_tokens, False)
    assert len(streamed) >= 2
    assert audio["lanes"].size == audio["dynamic"].size
    np.testing.assert_allclose(audio["lanes"], audio["dynamic"], rtol=0,
                               atol=1e-4 * float(np.abs(audio["dynamic"]).max()))


@settings(max_examples=300, deadline=None)
@given(hop=st.integers(2, 40), scale=st.floats(1.0, 4.0), cap_over=st.one_of(st.none(), st.integers(0, 120)),
       prompt=st.integers(0, 200), first_hop=st.one_of(st.none(), st.integers(5, 30)))
def test_an_offline_schedule_covers_the_tokens_on_whole_chunks(hop: int, scale: float, cap_over: int | None,
                                                              prompt: int, first_hop: int | None) -> None:
    """For any hop, growth, cap and prompt: grown_start's chunks tile the tokens, each of at least the hop and
    at most the hop the schedule grows to, the first ending on a whole chunk after the prompt (and every one
    where that hop is a multiple of the hop), the rest of that hop; where its first would be shorter than
    the hop, or with no growth, it is the streaming schedule; first_chunk_tokens does not change once
    chunks have gone."""
    cap = None if cap_over is None else hop + cap_over
    grown = grown_hops(hop, scale, cap)[-1]
    s = ChunkSchedule(hop, 3, prompt_tokens=prompt, first_hop=first_hop, hop_scale=scale, max_hop=cap,
                      grown_start=True)
    need = s.first_chunk_tokens()
    chunks = _chunks(s, 12 * max(grown, hop + 24))
    assert s.first_chunk_tokens() == need == chunks[0][1] + 3
    assert chunks[0][0] == 0 and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    if grown > hop and (grown - (prompt + grown) % hop) >= hop:
        assert all(hop <= end - start <= grown for start, end in chunks) and (prompt + chunks[0][1]) % hop == 0
        assert {end - start for start, end in chunks[1:]} == {grown}
        if grown % hop == 0:  # a multiple of the hop (upstream's growth): every chunk on whole chunks
            assert all((prompt + end) % hop == 0 for _, end in chunks)
    else:
        plain = ChunkSchedule(hop, 3, prompt_tokens=prompt, first_hop=first_hop, hop_scale=scale, max_hop=cap)
        assert chunks == _chunks(plain, 12 * max(grown, hop + 24))
