"""Streaming flow with estimator caches (cosyedge_models.synthesis.flow.FlowStream) on the tiny
bundle: every non-final chunk equals upstream's full-prefix streaming pass
(our old path and the official modules), for aligned and unaligned hops; the
"cached" final chunk stays close to upstream's full pass; the estimator work
grows linearly with the audio instead of quadratically."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.synthesis.api import PromptAudio, SynthesisRequest
from cosyedge_models.synthesis.flow import EstimatorWork, FlowPrompt, FlowStream, cache_bytes_per_frame
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.streaming import ChunkSchedule
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer

from tests.support.components import require_module

# Cached vs full-prefix windows: the same fp32 ops over other tensor shapes,
# so only summation order differs (measured max 3.3e-6 on mels of max ~5).
CHUNK_ATOL = 2e-5
# "cached" final chunk vs upstream's final full-attention pass over everything:
# mean |difference| relative to the chunk's mean |mel|; measured 0.11-0.13 on
# the random-weight tiny model (max |difference| 0.57-0.85 on mels of max ~5).
# Its cause is the earlier frames' states (streaming-mode in the cache,
# full-attention in upstream's pass): a non-streaming encoder or full
# attention inside the last window changes it by < 1e-4.
FINAL_CHUNK_REL = 0.2


@pytest.fixture(scope="module")
def voice(engine: CosyVoiceSynthesizer) -> FlowPrompt:
    """A zero-shot prompt, so the prompt tokens shift the chunk grid."""
    sr = 16000
    t = np.arange(int(2.3 * sr)) / sr
    phase = 2 * np.pi * np.cumsum(140 + 30 * np.sin(2 * np.pi * 0.7 * t)) / sr
    pcm = (0.2 * sum(np.sin(k * phase) / k for k in range(1, 8))).astype(np.float32)
    request = SynthesisRequest(text="x", mode="zero_shot",
                               prompt=PromptAudio(pcm=pcm, sample_rate=sr, text="What the speaker says."))
    flow = engine.conditioning.build(request).flow
    assert flow.tokens.size % engine.bundle.flow.chunk_tokens != 0  # the aligned first hop is then stretched
    return flow


def tokens(engine: CosyVoiceSynthesizer, n: int = 140, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, engine.bundle.llm.speech_token_size, n)


def chunks(engine: CosyVoiceSynthesizer, voice: FlowPrompt, n: int, hop: int,
           first_hop: int | None) -> list[tuple[int, int]]:
    """(start, end) tokens of each non-final chunk, as the engine schedules them."""
    schedule = ChunkSchedule(hop, engine.bundle.flow.pre_lookahead_len, prompt_tokens=len(voice.tokens),
                             first_hop=first_hop)
    out = []
    while (chunk := schedule.next_chunk(n)) is not None:
        out.append((chunk.start, chunk.end))
    return out


def run_stream(engine: CosyVoiceSynthesizer, voice: FlowPrompt, toks: np.ndarray, spans: list[tuple[int, int]],
               final_chunk: str = "cached") -> tuple[FlowStream, list[np.ndarray], np.ndarray]:
    look = engine.bundle.flow.pre_lookahead_len
    stream = engine.flow.stream(voice, final_chunk)  # type: ignore[arg-type]
    mels = [stream.push(toks[: end + look]) for _, end in spans]
    return stream, mels, stream.finish(toks)


HOPS = [(25, None), (25, 7), (13, None)]  # aligned first hop; unaligned first hop; unaligned hops


@pytest.mark.parametrize(("hop", "first_hop"), HOPS, ids=["aligned", "unaligned-first", "unaligned-hop"])
def test_cached_chunks_equal_the_full_prefix_pass(engine: CosyVoiceSynthesizer, voice: FlowPrompt, hop: int,
                                                  first_hop: int | None) -> None:
    toks = tokens(engine)
    spans = chunks(engine, voice, len(toks), hop, first_hop)
    assert len(spans) >= 4
    look, ratio = engine.bundle.flow.pre_lookahead_len, engine.bundle.token_mel_ratio
    old_work = EstimatorWork()
    stream, mels, _ = run_stream(engine, voice, toks, spans)
    worst = 0.0
    for (start, end), mel in zip(spans, mels, strict=True):
        old = engine.flow.mel(toks[: end + look], voice, finalize=False, streaming=True, work=old_work)
        assert mel.shape == (1, engine.bundle.mel_bins, (end - start) * ratio)
        worst = max(worst, float(np.abs(mel - old[:, :, start * ratio:]).max()))
    assert worst < CHUNK_ATOL, worst
    # Linear work: every call evaluates its new frames plus at most one unfinished
    # mask chunk, per Euler step; the old path re-evaluates the whole prefix.
    steps, chunk = engine.bundle.flow.n_timesteps, engine.flow.config.chunk_tokens * ratio
    frames = len(voice.feat) + spans[-1][1] * ratio
    final_frames = (len(toks) - spans[-1][1]) * ratio
    assert stream.work.frames <= steps * (frames + final_frames + (len(spans) + 1) * chunk)  # final chunk included
    assert old_work.frames > 2 * stream.work.frames
    # the encoder too: each call runs its new tokens, the look-ahead and at most one unfinished chunk
    tokens_total = len(voice.tokens) + len(toks)
    calls = len(spans) + 1
    assert stream.work.encoder_tokens <= tokens_total + calls * (engine.flow.config.chunk_tokens + look)
    assert old_work.encoder_tokens > 2 * stream.work.encoder_tokens


def test_chunks_match_the_official_flow(engine: CosyVoiceSynthesizer, voice: FlowPrompt, tiny_model_dir: Path) -> None:
    """Against upstream's own modules: flow.inference(streaming=True) over the
    growing prefix for the chunks, the non-streaming finalize pass for the end
    ("upstream" final chunk)."""
    torch = require_module("torch")
    from cosyedge_build.reference.pipeline import load_reference

    flow = load_reference(tiny_model_dir).flow
    toks = tokens(engine, 110, seed=1)
    spans = chunks(engine, voice, len(toks), 25, 7)
    look, ratio = engine.bundle.flow.pre_lookahead_len, engine.bundle.token_mel_ratio
    _, mels, last = run_stream(engine, voice, toks, spans, final_chunk="upstream")

    def upstream(prefix: np.ndarray, streaming: bool, finalize: bool) -> np.ndarray:
        with torch.no_grad():
            mel, _ = flow.inference(
                token=torch.from_numpy(prefix[None]), token_len=torch.tensor([len(prefix)]),
                prompt_token=torch.from_numpy(voice.tokens[None].astype(np.int64)),
                prompt_token_len=torch.tensor([len(voice.tokens)]),
                prompt_feat=torch.from_numpy(voice.feat[None]), prompt_feat_len=torch.tensor([len(voice.feat)]),
                embedding=torch.from_numpy(voice.embedding[None]), streaming=streaming, finalize=finalize)
        return np.asarray(mel.numpy())

    for (start, end), mel in zip(spans, mels, strict=True):
        ref = upstream(toks[: end + look], streaming=True, finalize=False)[:, :, start * ratio:]
        assert np.abs(mel - ref).max() / np.abs(ref).max() < 1e-4
    ref = upstream(toks, streaming=False, finalize=True)[:, :, spans[-1][1] * ratio:]
    assert np.abs(last - ref).max() / np.abs(ref).max() < 1e-4


def test_cached_final_chunk_stays_close_to_upstream(engine: CosyVoiceSynthesizer, voice: FlowPrompt) -> None:
    toks = tokens(engine, seed=2)
    spans = chunks(engine, voice, len(toks), 25, None)
    up, up_mels, up_last = run_stream(engine, voice, toks, spans, final_chunk="upstream")
    ca, ca_mels, ca_last = run_stream(engine, voice, toks, spans, final_chunk="cached")
    for a, b in zip(up_mels, ca_mels, strict=True):
        np.testing.assert_array_equal(a, b)
    assert up_last.shape == ca_last.shape and up_last.shape[2] > 0
    rel = float(np.abs(ca_last - up_last).mean() / np.abs(up_last).mean())
    assert rel < FINAL_CHUNK_REL, rel
    # The "upstream" end costs a full-length pass; "cached" only the last window.
    ratio = engine.bundle.token_mel_ratio
    total, chunk = len(voice.feat) + len(toks) * ratio, engine.bundle.flow.chunk_tokens * ratio
    assert up.work.frames - ca.work.frames >= engine.bundle.flow.n_timesteps * (total - 2 * chunk)


def test_engine_streaming_cost_is_linear(engine: CosyVoiceSynthesizer, tiny_bundle: Path) -> None:
    """Through the engine: the estimator work of a streaming request (cached
    final chunk) is about that of the offline request, not a multiple of it."""
    text = "Hello from the tiny model, one two three, four five six seven eight nine ten."

    def frames(eng: CosyVoiceSynthesizer, stream: bool) -> tuple[int, int]:
        chunks = list(eng.synthesize(SynthesisRequest(text=text, seed=3, stream=stream)))
        return chunks[-1].times.flow_frames, sum(c.pcm.size for c in chunks)

    offline, n_off = frames(engine, False)
    streamed, n_str = frames(engine, True)
    assert n_off == n_str
    assert streamed <= 1.3 * offline, (streamed, offline)
    upstream_engine = load_synthesizer(tiny_bundle, settings=SynthesisSettings(flow_final_chunk="upstream"))
    try:
        up, _ = frames(upstream_engine, True)
    finally:
        upstream_engine.close()
    # "upstream" adds a full-length pass, less the last window "cached" evaluates
    chunk = engine.bundle.flow.chunk_tokens * engine.bundle.token_mel_ratio
    assert up - streamed >= offline - engine.bundle.flow.n_timesteps * 2 * chunk


def test_settings_and_cache_size(engine: CosyVoiceSynthesizer, voice: FlowPrompt) -> None:
    with pytest.raises(ValueError, match="flow_final_chunk must be one of upstream, cached"):
        SynthesisSettings(flow_final_chunk="fast")  # type: ignore[arg-type]
    toks = tokens(engine, 80)
    stream, _, _ = run_stream(engine, voice, toks, chunks(engine, voice, len(toks), 25, None))
    dims = engine.flow.cache_dims
    per_frame = cache_bytes_per_frame(dims, engine.bundle.flow.n_timesteps)
    assert stream.committed > 0 and stream.cache_bytes() >= stream.committed * per_frame


def test_bounded_left_context(engine: CosyVoiceSynthesizer, voice: FlowPrompt) -> None:
    """flow_left_chunks: a bound no longer than the utterance changes nothing;
    a short one bounds the cache memory and changes the mel (documented)."""
    with pytest.raises(ValueError, match="flow_left_chunks must be -1"):
        SynthesisSettings(flow_left_chunks=-2)
    toks = tokens(engine, 200, seed=5)
    spans = chunks(engine, voice, len(toks), 25, None)
    look = engine.bundle.flow.pre_lookahead_len

    def run(left: int) -> tuple[FlowStream, np.ndarray, int]:
        stream = engine.flow.stream(voice, "cached", left)
        mels, peak = [], 0
        for _, end in spans:
            mels.append(stream.push(toks[: end + look]))
            peak = max(peak, sum(c.nbytes() for c in stream.caches))  # the estimator's (the encoder's are small)
        mels.append(stream.finish(toks))
        return stream, np.concatenate(mels, axis=2), peak

    _, full, full_peak = run(-1)
    _, same, _ = run(100)
    np.testing.assert_array_equal(full, same)
    short, bounded, peak = run(1)
    assert bounded.shape == full.shape and np.isfinite(bounded).all() and not np.array_equal(bounded, full)
    chunk = engine.bundle.flow.chunk_tokens * engine.bundle.token_mel_ratio
    per_frame = cache_bytes_per_frame(engine.flow.cache_dims, engine.bundle.flow.n_timesteps)
    assert short.committed > 4 * chunk
    assert peak < full_peak and max(c.length for c in short.caches) <= 2 * chunk
    assert peak <= 4 * chunk * per_frame + 10 * short.caches[0].conv.nbytes


def test_cache_memory_from_the_bundle_dims(engine: CosyVoiceSynthesizer, tiny_bundle: Path) -> None:
    from cosyedge_models.bundle.memory_budget import bundle_budget, flow_stream_cache_bytes_per_second

    full = {"stages": {"flow_estimator": {"cache": {
        "blocks": 56, "heads": 8, "head_dim": 64, "convs": 31, "conv_channels": 512, "conv_history": 2,
        "stream_cache": True}}}, "flow": {"n_timesteps": 10}, "token_rate_hz": 25, "token_mel_ratio": 2}
    # 56 blocks x 10 steps x 2 CFG rows x (K, V) x 8 heads x 64 x 4 bytes, 50 frames per second
    assert flow_stream_cache_bytes_per_second(full) == 56 * 10 * 2 * 2 * 8 * 64 * 4 * 50  # 218.75 MiB/s
    assert flow_stream_cache_bytes_per_second(full, 2) == 56 * 10 * 2 * 2 * 8 * 64 * 2 * 50
    assert flow_stream_cache_bytes_per_second({"stages": {}}) is None
    full["stages"]["flow_encoder"] = {"cache": {"layers": 6, "up_layers": 4, "heads": 8, "head_dim": 64}}
    encoder = 25 * 6 * 2 * 8 * 64 * 4 + 50 * 4 * 2 * 8 * 64 * 4  # 1.37 MiB/s
    assert flow_stream_cache_bytes_per_second(full) == 56 * 10 * 2 * 2 * 8 * 64 * 4 * 50 + encoder
    budget = bundle_budget(tiny_bundle, engine.bundle.manifest, "fp32")
    assert any("per second of audio per streaming request" in n for n in budget.notes)
