"""The CosyVoice engine on the tiny bundle: modes, streaming, per-request
state, cancellation and bad input."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.errors import BundleError, RequestError
from cosyedge_models.synthesis.api import PromptAudio, SynthesisRequest
from cosyedge_models.synthesis.features import prompt_mel
from cosyedge_models.synthesis.flow import FlowPrompt
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer
from cosyedge_models.synthesis.vocoder import VocoderStream

TEXT = "Hello from the tiny model, one two three."


def audio(engine: CosyVoiceSynthesizer, **kw: object) -> tuple[np.ndarray, list]:  # type: ignore[type-arg]
    chunks = list(engine.synthesize(SynthesisRequest(**{"text": TEXT, "seed": 3, **kw})))  # type: ignore[arg-type]
    return np.concatenate([c.pcm for c in chunks]), chunks


def prompt_audio(seconds: float = 3.0, sr: int = 16000) -> PromptAudio:
    """A voiced, speech-like test signal (harmonics with a moving pitch and an envelope)."""
    t = np.arange(int(seconds * sr)) / sr
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    x = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2)
    return PromptAudio(pcm=(0.2 * x).astype(np.float32), sample_rate=sr, text="This is what the speaker says.")


def test_offline_and_streaming_give_audio_with_the_same_length(engine: CosyVoiceSynthesizer) -> None:
    offline, off_chunks = audio(engine, stream=False)
    streamed, chunks = audio(engine, stream=True)
    assert len(off_chunks) == 1 and off_chunks[0].last
    assert len(chunks) > 2 and chunks[-1].last and not any(c.last for c in chunks[:-1])
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert offline.size == streamed.size > engine.sample_rate
    assert np.isfinite(streamed).all() and np.abs(streamed).max() <= engine.bundle.hift.audio_limit
    t = chunks[-1].times
    assert t.first_audio_ms is not None and t.llm_tokens > 0 and t.flow_ms > 0 and t.vocoder_ms > 0


def test_same_seed_same_audio_other_seed_other_audio(engine: CosyVoiceSynthesizer) -> None:
    a, _ = audio(engine, stream=True)
    b, _ = audio(engine, stream=True)
    c, _ = audio(engine, stream=True, seed=4)
    assert np.array_equal(a, b)
    assert a.size != c.size or not np.array_equal(a, c)


def test_concurrent_requests_keep_their_own_state(engine: CosyVoiceSynthesizer) -> None:
    """Upstream keeps streaming state on the shared instance; ours is per
    request: interleaved requests give exactly what they give alone."""
    alone = {seed: audio(engine, stream=True, seed=seed)[0] for seed in (3, 5)}
    results: dict[int, np.ndarray] = {}

    def run(seed: int) -> None:
        results[seed] = audio(engine, stream=True, seed=seed)[0]

    threads = [threading.Thread(target=run, args=(s,)) for s in (3, 5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for seed in (3, 5):
        assert np.array_equal(results[seed], alone[seed])


def test_streaming_flow_is_chunk_causal(engine: CosyVoiceSynthesizer) -> None:
    """With streaming (static chunk) masks, the mel of a chunk does not change
    when later tokens arrive: what a chunk gets while streaming is what the
    longer sequence gives for those frames."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, engine.bundle.llm.speech_token_size, 90)
    voice = engine.conditioning.build(SynthesisRequest(text="x")).flow
    hop, look, ratio = 25, engine.bundle.flow.pre_lookahead_len, engine.bundle.token_mel_ratio
    short = engine.flow.mel(tokens[: hop + look], voice, finalize=False, streaming=True)
    longer = engine.flow.mel(tokens[: 3 * hop + look], voice, finalize=False, streaming=True)
    assert short.shape[2] == hop * ratio
    np.testing.assert_allclose(short, longer[:, :, : hop * ratio], rtol=1e-4, atol=1e-4)


def test_streaming_vocoder_matches_offline_up_to_the_crossfade_tolerance(engine: CosyVoiceSynthesizer) -> None:
    """Same mel, vocoded in streaming chunks (mel/source cache, Hamming cross-fade)
    and in one go. Before the first cross-fade the samples are the same; after
    it the harmonic source restarts its phase at every chunk (as upstream), so
    the waveforms differ in phase but not in spectrum: the documented tolerance
    is a mean absolute log-mel difference below 0.3 (the mel's own spread is
    ~0.6) with the same length."""

    class Silent:
        def standard_normal(self, size: tuple[int, ...], dtype: type[np.float32]) -> np.ndarray:
            return np.zeros(size, dtype)

    rng = np.random.default_rng(1)
    tokens = rng.integers(0, engine.bundle.llm.speech_token_size, 150)
    voice = engine.conditioning.build(SynthesisRequest(text="x")).flow
    mel = engine.flow.mel(tokens, voice, finalize=True, streaming=True)
    offline = engine.vocoder.run(mel, Silent())[0][0]
    stream = VocoderStream(engine.vocoder, Silent())
    hop = engine.bundle.streaming.token_hop_len * engine.bundle.token_mel_ratio
    pieces = [stream.push(mel[:, :, s:s + hop], final=s + hop >= mel.shape[2]) for s in range(0, mel.shape[2], hop)]
    streamed = np.concatenate(pieces)
    assert streamed.size == offline.size
    head = hop * engine.bundle.hift.upsample_factor - engine.bundle.streaming.source_cache_len
    np.testing.assert_allclose(streamed[:head], offline[:head], atol=1e-4)
    diff = np.abs(prompt_mel(streamed) - prompt_mel(offline)).mean()
    assert diff < 0.3


def test_modes_with_a_prompt_recording(engine: CosyVoiceSynthesizer) -> None:
    prompt = prompt_audio()
    for mode in ("zero_shot", "cross_lingual"):
        pcm, chunks = audio(engine, mode=mode, prompt=prompt, stream=False)
        assert pcm.size > 0 and chunks[-1].last
    cond = engine.conditioning.build(SynthesisRequest(text="x", mode="zero_shot", prompt=prompt))
    assert cond.prompt_text and cond.prompt_speech and cond.flow.tokens.size == len(cond.prompt_speech)
    assert cond.flow.feat.shape == (2 * cond.flow.tokens.size, engine.bundle.mel_bins)
    cross = engine.conditioning.build(SynthesisRequest(text="x", mode="cross_lingual", prompt=prompt))
    assert not cross.prompt_text and not cross.prompt_speech and cross.flow.tokens.size > 0
    instruct = engine.conditioning.build(SynthesisRequest(text="x", mode="instruct", instruct_text="Speak slowly."))
    assert instruct.prompt_text[-1] == engine.tokenizer.token_to_id("<|endofprompt|>")
    sft = engine.conditioning.build(SynthesisRequest(text="x"))
    assert not sft.prompt_text and sft.flow.tokens.size == 0 and isinstance(sft.flow, FlowPrompt)


def test_cancel_stops_a_stream(engine: CosyVoiceSynthesizer) -> None:
    cancel = threading.Event()
    got = []
    for chunk in engine.synthesize(SynthesisRequest(text=TEXT, seed=3), cancel):
        got.append(chunk)
        cancel.set()
    full = list(engine.synthesize(SynthesisRequest(text=TEXT, seed=3)))
    assert len(got) == 1 < len(full)


@pytest.mark.parametrize(("request_kw", "code"), [
    ({"text": ""}, "empty_text"),
    ({"text": "   "}, "empty_text"),
    ({"text": "x" * 5000}, "text_too_long"),
    ({"text": "bad\x00byte"}, "invalid_text"),
    ({"text": "?!..."}, "no_speakable_text"),
    ({"text": "Hi.", "voice": "nobody"}, "unknown_voice"),
    ({"text": "Hi.", "mode": "karaoke"}, "unknown_mode"),
    ({"text": "Hi.", "mode": "instruct"}, "missing_instruct_text"),
    ({"text": "Hi.", "mode": "zero_shot"}, "voice_unsuitable"),
    ({"text": "Hi.", "speed": 3.0, "stream": False}, "bad_speed"),
])
def test_bad_requests_get_a_coded_error(engine: CosyVoiceSynthesizer, request_kw: dict, code: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(RequestError) as err:
        list(engine.synthesize(SynthesisRequest(**request_kw)))
    assert err.value.code == code and str(err.value)


def test_bad_bundles_say_what_was_expected(tiny_bundle: Path, tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="no manifest.json"):
        load_bundle(tmp_path)
    with pytest.raises(BundleError, match="not a directory"):
        load_bundle(tmp_path / "missing")
    copy = tmp_path / "b"
    shutil.copytree(tiny_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(BundleError, match="format version 99.*re-export"):
        load_bundle(copy)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_bundle(copy)
    (copy / "manifest.json").write_text(json.dumps({**manifest, "family": "cosyvoice9"}))
    with pytest.raises(BundleError, match="not supported"):
        load_bundle(copy)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    (copy / "llm_decode.onnx").unlink()
    with pytest.raises(BundleError, match="llm_decode.onnx is missing"):
        load_bundle(copy)


def test_load_engine_uses_the_settings_backend(tiny_bundle: Path) -> None:
    # The bench and the daemon pass only settings: the backend they name must be the one loaded.
    engine = load_synthesizer(tiny_bundle, settings=SynthesisSettings(backend="ort-cuda", threads=1))
    try:
        assert engine.backend.name == "ort-cuda"
    finally:
        engine.close()
    with pytest.raises(ValueError, match="differs"):
        load_synthesizer(tiny_bundle, backend="ort", settings=SynthesisSettings(backend="ort-cuda"))
