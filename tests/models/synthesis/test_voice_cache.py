"""Per-voice prompt caches (models/synthesis/voice_cache.py) on the tiny bundle: a
saved voice streamed with its cache gives the same speech tokens (seeded
sampler) and the same audio as without it, for every mode that has a flow
prompt, while the first chunk's flow evaluates fewer frames; the device
store (BoundStepCache on the CPU provider) seeded from the prefix gives the
host mel; the cache's bounds, keys and what is not cached. `-m gpu`: the
same parity on ort-cuda."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cosyedge_daemon.cli.main import main
from cosyedge_models.backends.encoder_cache import EncoderPrefix
from cosyedge_models.backends.flow_cache import HostStepCache, PrefixRows
from cosyedge_models.backends.ort_cache import BoundCacheFactory
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.synthesis.api import AudioChunk, SynthesisRequest
from cosyedge_models.synthesis.flow import FlowDecoder, FlowPrompt, prompt_commit_frames
from cosyedge_models.synthesis.llm import LlmStats, SpeechTokenLM
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer
from cosyedge_models.synthesis.voice_cache import MIB, FlowPrefix, VoiceCache, build_flow_prefix, bundle_identity

from tests.models.synthesis.test_synthesizer import prompt_audio
from tests.support.components import require_cuda_provider
from tests.support.module_tmp import ModuleTmp
from tests.support.voices import bundle_with_voice

ATOL = 1e-5  # the brief's bound; on one backend the two paths are the same graph calls (measured 0.0)
TEXT = "The voice cache keeps what the prompt costs, so this sentence starts sooner."


@pytest.fixture(scope="module")
def voice_bundle(tiny_bundle: Path, module_tmp: ModuleTmp) -> Path:
    """The tiny bundle with a saved 4 s voice (several complete flow chunks)."""
    return bundle_with_voice(tiny_bundle, module_tmp.mktemp("vcache") / "bundle", 4.0,
                             "Hello, this is Alice speaking, slowly and clearly.")


@pytest.fixture(scope="module")
def vengine(voice_bundle: Path) -> Iterator[CosyVoiceSynthesizer]:
    eng = load_synthesizer(voice_bundle, settings=SynthesisSettings(overlap_stages=False))
    yield eng
    eng.close()


def record_tokens(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Every segment's speech tokens, as the engine's LLM yields them."""
    seen: list[list[int]] = []
    original = SpeechTokenLM.generate

    def generate(self: SpeechTokenLM, inp: object, sampler: object, stats: LlmStats | None = None) -> Iterator[int]:
        out: list[int] = []
        seen.append(out)
        for token in original(self, inp, sampler, stats):  # type: ignore[arg-type]
            out.append(token)
            yield token

    monkeypatch.setattr(SpeechTokenLM, "generate", generate)
    return seen


def stream(engine: CosyVoiceSynthesizer, mode: str, cache_mb: int,
           seed: int = 5) -> tuple[np.ndarray, list[AudioChunk]]:
    original = engine.settings
    engine.settings = dataclasses.replace(original, voice_cache_mb=cache_mb)
    try:
        request = SynthesisRequest(text=TEXT, mode=mode, voice="alice", stream=True, seed=seed,  # type: ignore[arg-type]
                                   instruct_text="Speak warmly." if mode == "instruct" else None)
        chunks = list(engine.synthesize(request))
    finally:
        engine.settings = original
    return np.concatenate([c.pcm for c in chunks]), chunks


@pytest.mark.parametrize("mode", ["zero_shot", "cross_lingual", "instruct"])
def test_cached_voice_gives_the_uncached_tokens_and_audio(vengine: CosyVoiceSynthesizer, mode: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = record_tokens(monkeypatch)
    vengine.voice_cache.clear()
    off, off_chunks = stream(vengine, mode, cache_mb=0)
    builds = vengine.voice_cache.stats.builds
    assert vengine.voice_cache.nbytes == 0  # off: nothing kept
    first, _ = stream(vengine, mode, cache_mb=512)  # builds the prefix
    warm, warm_chunks = stream(vengine, mode, cache_mb=512)  # uses it
    # zero_shot also keeps the LLM prefix (sos + transcript): a second entry
    assert vengine.voice_cache.stats.builds == builds + (2 if mode == "zero_shot" else 1)
    assert tokens[0] and tokens[0] == tokens[1] == tokens[2]
    assert off.size == warm.size == first.size and off_chunks[0].pcm.size == warm_chunks[0].pcm.size
    np.testing.assert_allclose(warm, off, rtol=0, atol=ATOL)
    np.testing.assert_allclose(first, off, rtol=0, atol=ATOL)
    # The cache was used: the prompt's committed frames were not evaluated again.
    committed = prompt_commit_frames(vengine.flow, voice_prompt(vengine).tokens.size)
    assert committed > 0
    n_steps = vengine.bundle.flow.n_timesteps
    assert off_chunks[-1].times.flow_frames - warm_chunks[-1].times.flow_frames == committed * n_steps


def test_sft_inline_prompt_and_bounded_context_are_not_cached(vengine: CosyVoiceSynthesizer) -> None:
    vengine.voice_cache.clear()
    builds = vengine.voice_cache.stats.builds
    list(vengine.synthesize(SynthesisRequest(text="Plain.", mode="sft", voice="alice", stream=True, seed=1)))
    inline = SynthesisRequest(text="Inline.", mode="zero_shot", prompt=prompt_audio(3.0), stream=True, seed=1)
    list(vengine.synthesize(inline))
    original = vengine.settings
    vengine.settings = dataclasses.replace(original, flow_left_chunks=1)
    try:
        list(vengine.synthesize(SynthesisRequest(text="Bounded.", mode="zero_shot", voice="alice", stream=True,
                                                 seed=1)))
    finally:
        vengine.settings = original
    # No flow prefix for any of them; the bounded-context zero_shot request still keeps its LLM
    # prefix (the LLM's input does not depend on the flow's left context).
    assert vengine.voice_cache.stats.builds == builds + 1 and vengine.voice_cache.part_nbytes("flow") == 0
    assert vengine.voice_cache.nbytes == vengine.voice_cache.part_nbytes("llm") > 0
    assert vengine.warm_voice(SynthesisRequest(text="x", mode="zero_shot", voice="alice")) is not None
    assert vengine.voice_cache.nbytes > 0


def test_cache_with_flow_batching_gives_the_same_audio(voice_bundle: Path) -> None:
    """Estimator calls through the stage batcher (flow_batching): the seeded caches run there too."""
    eng = load_synthesizer(voice_bundle, settings=SynthesisSettings(overlap_stages=False,
                                                            flow_batching=BatchSettings(max_batch_size=2)))
    try:
        off, _ = stream(eng, "zero_shot", cache_mb=0)
        on, _ = stream(eng, "zero_shot", cache_mb=256)
        warm, _ = stream(eng, "zero_shot", cache_mb=256)
        assert eng.voice_cache.stats.builds == 2 and eng.voice_cache.stats.hits == 2  # flow + LLM prefix
        np.testing.assert_allclose(on, off, rtol=0, atol=ATOL)
        np.testing.assert_allclose(warm, off, rtol=0, atol=ATOL)
    finally:
        eng.close()


def voice_prompt(engine: CosyVoiceSynthesizer) -> FlowPrompt:
    return engine.conditioning.build(SynthesisRequest(text="x", mode="zero_shot", voice="alice")).flow


def push_all(decoder: FlowDecoder, prompt: FlowPrompt, toks: np.ndarray, prefix: FlowPrefix | None) -> np.ndarray:
    with decoder.stream(prompt, "cached", -1, prefix) as flow:
        if prefix is None:
            flow.prime()
        parts = [flow.push(toks[:end]) for end in (18, 40, 70)]
        parts.append(flow.finish(toks))
    return np.concatenate(parts, axis=2)


def test_device_store_seeded_from_the_prefix_gives_the_host_mel(vengine: CosyVoiceSynthesizer) -> None:
    prompt = voice_prompt(vengine)
    prefix = build_flow_prefix(vengine.flow, prompt)
    assert prefix is not None and prefix.committed == prompt_commit_frames(vengine.flow, prompt.tokens.size)
    toks = np.random.default_rng(3).integers(0, vengine.bundle.llm.speech_token_size, 70)
    host = FlowDecoder(vengine.bundle, vengine.flow.encoder, vengine.flow.estimator, HostStepCache)
    bound = FlowDecoder(vengine.bundle, vengine.flow.encoder, vengine.flow.estimator,
                        BoundCacheFactory("cpu"))  # type: ignore[arg-type]
    reference = push_all(host, prompt, toks, None)
    np.testing.assert_array_equal(push_all(host, prompt, toks, prefix), reference)
    np.testing.assert_allclose(push_all(bound, prompt, toks, prefix), reference, rtol=0, atol=ATOL)
    # the shared rows stayed as built (requests append to their own buffers)
    again = build_flow_prefix(vengine.flow, prompt)
    assert again is not None
    for a, b in zip(prefix.step_kv, again.step_kv, strict=True):
        np.testing.assert_array_equal(a.host, b.host)
    # one upload per voice and device: a second stream copies from it, with the same mel
    assert prefix.device_nbytes() == sum(r.host.nbytes for r in prefix.step_kv)
    np.testing.assert_allclose(push_all(bound, prompt, toks, prefix), reference, rtol=0, atol=ATOL)
    assert prefix.device_nbytes() == sum(r.host.nbytes for r in prefix.step_kv)


def fake_prefix(mb: float) -> FlowPrefix:
    kv = np.zeros(int(mb * MIB) // 4, np.float32)
    empty = np.zeros(0, np.float32)
    encoder = EncoderPrefix(PrefixRows(empty), PrefixRows(empty), empty, empty)
    return FlowPrefix(50, encoder, (PrefixRows(kv),), (empty,))


def test_device_copies_are_freed_when_retired_and_no_request_reads_them() -> None:
    rows = PrefixRows(np.ones((3, 4), np.float32))
    uploads: list[str] = []
    freed: list[str] = []

    def upload(host: np.ndarray) -> str:
        uploads.append("copy")
        return f"copy{len(uploads)}"

    with rows.lease(("gpu", 0), upload, freed.append) as first:
        with rows.lease(("gpu", 0), upload, freed.append) as again:
            assert first == again == "copy1" and uploads == ["copy"]  # one upload per device
        rows.retire()  # the voice left the cache while a request still copies from it
        assert freed == [] and rows.device_nbytes() == rows.host.nbytes
    assert freed == ["copy1"] and rows.device_nbytes() == 0  # freed when that lease ended
    with rows.lease(("gpu", 0), upload, freed.append) as late:  # a request that got it before
        assert late == "copy2"
    assert freed == ["copy1", "copy2"]


def test_evicted_and_cleared_voices_free_their_device_copies() -> None:
    cache = VoiceCache(3 * MIB, "bundle-a")
    freed: list[str] = []
    prefixes = {name: fake_prefix(1.5) for name in "abc"}
    for name, prefix in prefixes.items():
        with prefix.step_kv[0].lease(("gpu", 0), lambda host, n=name: n, freed.append):
            pass
        assert cache.get(name, "d1", lambda p=prefix: p) is prefix
    assert cache.stats.evictions == 1 and freed == ["a"]  # a went to make room for c
    cache.clear()
    assert sorted(freed) == ["a", "b", "c"]


def test_cache_is_bounded_and_keyed_by_content() -> None:
    cache = VoiceCache(3 * MIB, "bundle-a")
    builds: list[str] = []

    def build(name: str, mb: float) -> FlowPrefix:
        builds.append(name)
        return fake_prefix(mb)

    a = cache.get("a", "d1", lambda: build("a", 1))
    assert cache.get("a", "d1", lambda: build("a", 1)) is a and builds == ["a"]
    cache.get("b", "d1", lambda: build("b", 1.5))
    cache.get("a", "d1", lambda: build("a", 1))  # a is now the most recently used
    cache.get("c", "d1", lambda: build("c", 1))  # 3.5 MiB > 3: b goes
    assert cache.nbytes <= 3 * MIB and cache.stats.evictions == 1
    cache.get("a", "d1", lambda: build("a", 1))
    cache.get("b", "d1", lambda: build("b", 1.5))
    assert builds == ["a", "b", "c", "b"]
    cache.get("a", "d2", lambda: build("a2", 1))  # the voice file changed under the same name
    assert builds[-1] == "a2"
    assert cache.get("big", "d1", lambda: build("big", 4)) is None and cache.stats.too_big == 1
    assert cache.get("big", "d1", lambda: build("big", 4)) is None and builds.count("big") == 1
    off = VoiceCache(0, "bundle-a")
    assert off.get("a", "d1", lambda: build("never", 1)) is None and "never" not in builds
    assert bundle_identity("/b", "{}", "fp32") != bundle_identity("/b", '{"v": 1}', "fp32")
    assert bundle_identity("/b", "{}", "fp32") != bundle_identity("/b", "{}", "fp16")


def test_a_reloaded_engine_starts_empty(voice_bundle: Path) -> None:
    eng = load_synthesizer(voice_bundle, settings=SynthesisSettings(overlap_stages=False, voice_cache_mb=64))
    try:
        assert eng.warm_voice(SynthesisRequest(text="x", mode="zero_shot", voice="alice")) is not None
        assert eng.voice_cache.nbytes > 0
    finally:
        eng.close()
    assert eng.voice_cache.nbytes == 0
    again = load_synthesizer(voice_bundle, settings=SynthesisSettings(overlap_stages=False))
    try:
        assert again.voice_cache.nbytes == 0 and again.voice_cache.bundle_id == eng.voice_cache.bundle_id
    finally:
        again.close()
    with pytest.raises(ValueError, match="voice_cache_mb"):
        SynthesisSettings(voice_cache_mb=-1)


def test_bench_voice_reports_the_cache_off_and_on(voice_bundle: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    wav = voice_bundle.parent / "alice.wav"
    assert main(["bench", "--bundle", str(voice_bundle), "--voice", "alice", "--voice-wav", str(wav), "--repeats", "1",
                 "--concurrency", "1", "--long-seconds", "2", "--serial", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["voice"] == "alice"
    vc = r["voice_cache"]
    assert vc["off_first_audio_ms"] > 0 and vc["on_first_audio_ms"] > 0 and vc["ratio"] > 0
    assert vc["cached_frames"] > 0 and vc["prefix_mb"] > 0 and "error" not in vc
    assert vc["llm_cacheable_positions"] < vc["llm_prefill_positions"]
    assert vc["llm_prefix"] == "on" and vc["llm_prefix_positions"] == vc["llm_cacheable_positions"]
    assert vc["llm_prefill_off_ms"] > 0 and vc["llm_prefill_on_ms"] > 0 and vc["llm_prefix_kib"] > 0
    assert len(vc["llm_prefill_on_runs_ms"]) == 3 and vc["llm_prefill_max_abs_logp_diff"] <= ATOL
    assert vc["inline_first_audio_ms"] > 0 and vc["inline_seconds"] == 4.0
    assert set(vc["off_first_chunk_stages_ms"]) >= {"llm", "flow", "vocoder"}
    assert main(["bench", "--bundle", str(voice_bundle), "--voice", "nobody", "--repeats", "1"]) == 2
    assert "--voice nobody" in capsys.readouterr().err


@pytest.mark.gpu
def test_cached_voice_parity_on_ort_cuda(voice_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same parity on the GPU: device step caches seeded from the host prefix."""
    require_cuda_provider()
    tokens = record_tokens(monkeypatch)
    eng = load_synthesizer(voice_bundle, settings=SynthesisSettings(backend="ort-cuda"))
    try:
        assert getattr(eng.flow.estimator, "on_device", False)
        off, off_chunks = stream(eng, "zero_shot", cache_mb=0)
        warm_up, _ = stream(eng, "zero_shot", cache_mb=512)
        warm, warm_chunks = stream(eng, "zero_shot", cache_mb=512)
        assert eng.voice_cache.stats.builds == 2 and eng.voice_cache.stats.hits >= 2  # flow + LLM prefix
        assert tokens[0] and tokens[0] == tokens[1] == tokens[2]
        np.testing.assert_allclose(warm, off, rtol=0, atol=ATOL)
        np.testing.assert_allclose(warm_up, off, rtol=0, atol=ATOL)
        assert warm_chunks[-1].times.flow_frames < off_chunks[-1].times.flow_frames
    finally:
        eng.close()


def test_the_daemon_setting_reaches_the_engine(voice_bundle: Path, tmp_path: Path) -> None:
    from cosyedge_daemon.settings.loader import load_settings
    from cosyedge_daemon.settings.schema import Settings
    from cosyedge_daemon.synthesizers.factory import load_local_synthesizer
    from cosyedge_models.settings_schema import ConfigError

    config = tmp_path / "cosyedge.toml"
    config.write_text('device_id = "t"\n[tts]\nvoice_cache_mb = 0\n')
    custom = load_local_synthesizer(load_settings(config), bundle=str(voice_bundle))
    default = load_local_synthesizer(Settings(device_id="t"), bundle=str(voice_bundle))
    try:
        assert isinstance(custom, CosyVoiceSynthesizer) and isinstance(default, CosyVoiceSynthesizer)
        assert (custom.settings.voice_cache_mb, default.settings.voice_cache_mb) == (0, 2048)
        assert custom.voice_cache.max_bytes == 0 and default.voice_cache.max_bytes == 2048 * MIB
    finally:
        custom.close()
        default.close()
    config.write_text('device_id = "t"\n[tts]\nvoice_cache_mb = -5\n')
    with pytest.raises(ConfigError, match="voice_cache_mb"):
        load_settings(config)
