"""The LLM half of the per-voice prompt cache (models/synthesis/llm_prefix.py)
on the tiny bundle: a prefill that starts from the saved KV of sos + the
transcript gives the full prefill's log-probabilities and cache (host, bound,
fixed-size and batched loops), the same speech tokens under a seeded sampler
and the same audio; the entries are keyed and bounded with the flow's; a
reloaded engine starts without them; a bundle exported before (llm_decode of
one position) runs uncached. `-m gpu`: the parity on ort-cuda."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
import pytest
from cosyedge_models.backends.base import DecodeLoop, HostDecodeLoop
from cosyedge_models.backends.ort import BoundDecodeLoop, OrtSession
from cosyedge_models.backends.ort_graph_decode import GraphDecoder
from cosyedge_models.batching.llm_batcher import LlmBatcher
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.bundle.loader import load_bundle, sha256_file
from cosyedge_models.errors import SynthesisError
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.llm import LlmInput, LlmStats, SpeechTokenLM
from cosyedge_models.synthesis.llm_prefix import LlmPrefix
from cosyedge_models.synthesis.sampling import TokenSampler
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer
from cosyedge_models.synthesis.voice_cache import MIB, VoiceCache
from cosyedge_models.tools.voice_bench import llm_prefix_report

from tests.models.synthesis.test_voice_cache import record_tokens, stream, voice_bundle  # noqa: F401 (fixture)
from tests.support.components import require_cuda_provider

ATOL = 1e-5
RNG = np.random.default_rng(11)
PROMPT_TEXT = [int(t) for t in RNG.integers(10, 400, 23)]
PROMPT_SPEECH = [int(t) for t in RNG.integers(0, 200, 37)]
TEXT = [int(t) for t in RNG.integers(10, 400, 9)]


class RecordingSampler(TokenSampler):
    """A seeded sampler that keeps every step's log-probabilities."""

    def __init__(self, lm: SpeechTokenLM, seed: int) -> None:
        super().__init__(lm.config.sampling, lm.config.eos_token, np.random.default_rng(seed))
        self.seen: list[np.ndarray] = []

    def sample(self, logp: np.ndarray, decoded: Sequence[int], ignore_eos: bool) -> int:
        self.seen.append(np.array(logp, copy=True))
        return super().sample(logp, decoded, ignore_eos)


def generate(lm: SpeechTokenLM, prefix: LlmPrefix | None, seed: int = 3) -> tuple[list[int], RecordingSampler,
                                                                                    LlmStats]:
    sampler, stats = RecordingSampler(lm, seed), LlmStats()
    inp = LlmInput(text=TEXT, prompt_text=PROMPT_TEXT, prompt_speech=PROMPT_SPEECH, prefix=prefix)
    return list(lm.generate(inp, sampler, stats)), sampler, stats


def assert_same_run(a: tuple[list[int], RecordingSampler, LlmStats],
                    b: tuple[list[int], RecordingSampler, LlmStats]) -> None:
    assert a[0] and a[0] == b[0]
    assert len(a[1].seen) == len(b[1].seen)
    for x, y in zip(a[1].seen, b[1].seen, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=ATOL)


def assert_prefix_parity(lm: SpeechTokenLM) -> None:
    """The same run with and without the transcript's saved prefix, which covers sos + transcript."""
    off = generate(lm, None)
    on = generate(lm, lm.build_prefix(PROMPT_TEXT))
    assert_same_run(on, off)
    assert on[2].prefix_positions == 1 + len(PROMPT_TEXT)


@pytest.fixture(scope="module")
def engine(tiny_bundle: Path) -> Iterator[CosyVoiceSynthesizer]:
    eng = load_synthesizer(tiny_bundle, settings=SynthesisSettings(overlap_stages=False, threads=1))
    yield eng
    eng.close()


def _loops(engine: CosyVoiceSynthesizer) -> dict[str, Callable[[], DecodeLoop]]:
    pre, dec = engine.lm.prefill_session, engine.lm.decode_session
    assert isinstance(pre, OrtSession) and isinstance(dec, OrtSession)
    return {"host": lambda: HostDecodeLoop(pre, dec), "bound": lambda: BoundDecodeLoop(pre, dec, "cpu")}


@pytest.mark.parametrize("kind", ["host", "bound"])
def test_prefill_after_a_saved_prefix_is_the_full_prefill(engine: CosyVoiceSynthesizer, kind: str) -> None:
    lm = engine.lm
    assert engine.bundle.llm_decode_positions and lm.takes_prefix
    prefix = lm.build_prefix(PROMPT_TEXT)
    assert prefix.positions == 1 + len(PROMPT_TEXT) and not prefix.kv.flags.writeable
    prompt = lm.prompt_embeds(LlmInput(text=TEXT, prompt_text=PROMPT_TEXT, prompt_speech=PROMPT_SPEECH))
    full, seeded = _loops(engine)[kind](), _loops(engine)[kind]()
    assert seeded.takes_past
    np.testing.assert_allclose(seeded.prefill(prompt[:, prefix.positions:], prefix.kv), full.prefill(prompt),
                               rtol=0, atol=ATOL)
    assert seeded.cache_len == full.cache_len == prompt.shape[1]
    rng = np.random.default_rng(0)
    for _ in range(12):
        e = (rng.standard_normal((1, 1, prompt.shape[2])) * 0.05).astype(np.float32)
        np.testing.assert_allclose(seeded.step(e), full.step(e), rtol=0, atol=ATOL)
    again = lm.build_prefix(PROMPT_TEXT)
    np.testing.assert_array_equal(again.kv, prefix.kv)  # requests never write into the shared prefix
    with pytest.raises(ValueError, match="another prompt text"):
        LlmInput(text=TEXT, prompt_text=PROMPT_TEXT[1:], prefix=prefix)


def test_seeded_tokens_and_logp_are_the_same_with_the_prefix(engine: CosyVoiceSynthesizer) -> None:
    lm = engine.lm
    off = generate(lm, None)
    on = generate(lm, lm.build_prefix(PROMPT_TEXT))
    assert_same_run(on, off)
    assert (off[2].prefix_positions, on[2].prefix_positions) == (0, 1 + len(PROMPT_TEXT))


def test_the_batcher_prefills_after_the_prefix(engine: CosyVoiceSynthesizer) -> None:
    lm = engine.lm
    off = generate(lm, None)
    prefix = lm.build_prefix(PROMPT_TEXT)
    with LlmBatcher(lm, BatchSettings(max_batch_size=2)) as batcher:
        sampler, stats = RecordingSampler(lm, 3), LlmStats()
        inp = LlmInput(text=TEXT, prompt_text=PROMPT_TEXT, prompt_speech=PROMPT_SPEECH, prefix=prefix)
        tokens = list(batcher.generate(inp, sampler, stats))
    assert_same_run((tokens, sampler, stats), off)
    assert stats.prefix_positions == prefix.positions


def test_the_fixed_size_loop_starts_from_the_prefix(tiny_static_bundle: Path) -> None:
    eng = load_synthesizer(tiny_static_bundle, settings=SynthesisSettings(overlap_stages=False, graph_decode=True,
                                                                          threads=1))
    try:
        fixed = eng.lm.fixed_size_decode
        assert isinstance(fixed, GraphDecoder) and fixed.decode_session is not None
        loop = eng.lm.decode_loop(200)
        assert type(loop).__name__ == "GraphDecodeLoop" and loop.takes_past
        loop.close()
        assert_prefix_parity(eng.lm)
    finally:
        eng.close()


@pytest.fixture(scope="module")
def vengine(voice_bundle: Path) -> Iterator[CosyVoiceSynthesizer]:  # noqa: F811
    eng = load_synthesizer(voice_bundle, settings=SynthesisSettings(overlap_stages=False))
    yield eng
    eng.close()


def record_stats(monkeypatch: pytest.MonkeyPatch) -> list[LlmStats]:
    seen: list[LlmStats] = []
    original = SpeechTokenLM.generate

    def wrapped(self: SpeechTokenLM, inp: LlmInput, sampler: TokenSampler,
                stats: LlmStats | None = None) -> Iterator[int]:
        seen.append(stats if stats is not None else LlmStats())
        return original(self, inp, sampler, seen[-1])

    monkeypatch.setattr(SpeechTokenLM, "generate", wrapped)
    return seen


def offline(engine: CosyVoiceSynthesizer, cache_mb: int) -> np.ndarray:
    original = engine.settings
    engine.settings = dataclasses.replace(original, voice_cache_mb=cache_mb)
    try:
        request = SynthesisRequest(text="Offline requests reuse the prefix too.", mode="zero_shot", voice="alice",
                                   stream=False, seed=2)
        return np.concatenate([c.pcm for c in engine.synthesize(request)])
    finally:
        engine.settings = original


def test_saved_voice_streams_and_offline_give_the_same_tokens_and_audio(vengine: CosyVoiceSynthesizer,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    stats = record_stats(monkeypatch)
    tokens = record_tokens(monkeypatch)
    vengine.voice_cache.clear()
    off, _ = stream(vengine, "zero_shot", cache_mb=0)
    first, _ = stream(vengine, "zero_shot", cache_mb=256)  # builds both prefixes
    warm, _ = stream(vengine, "zero_shot", cache_mb=256)
    cond = vengine.conditioning.build(SynthesisRequest(text="x", mode="zero_shot", voice="alice"))
    positions = 1 + len(cond.prompt_text)
    assert [s.prefix_positions for s in stats] == [0, positions, positions]
    assert tokens[0] and tokens[0] == tokens[1] == tokens[2]
    np.testing.assert_allclose(first, off, rtol=0, atol=ATOL)
    np.testing.assert_allclose(warm, off, rtol=0, atol=ATOL)
    llm_bytes = vengine.voice_cache.part_nbytes("llm")
    b = vengine.bundle.llm
    assert llm_bytes == b.num_layers * 2 * b.num_kv_heads * positions * b.head_dim * 4
    np.testing.assert_allclose(offline(vengine, 256), offline(vengine, 0), rtol=0, atol=ATOL)
    assert stats[-2].prefix_positions == positions and stats[-1].prefix_positions == 0
    # cross_lingual and instruct keep no LLM prefix (sos alone; the request's instruct text)
    for mode in ("cross_lingual", "instruct"):
        request = SynthesisRequest(text="x", mode=mode, voice="alice", instruct_text="Calm.")  # type: ignore[arg-type]
        assert vengine.llm_prefix(vengine.conditioning.build(request), request.mode) is None


def fake_llm_prefix(mb: float, text: tuple[int, ...] = (1,)) -> LlmPrefix:
    return LlmPrefix(text, np.zeros((1, 1, 1, 1, int(mb * MIB) // 4, 1), np.float32))


def test_llm_entries_are_keyed_and_bounded_with_the_flow_entries() -> None:
    cache = VoiceCache(3 * MIB, "bundle-a")
    builds: list[str] = []

    def build(name: str, mb: float) -> LlmPrefix:
        builds.append(name)
        return fake_llm_prefix(mb)

    a = cache.get("a", "d1", lambda: build("a-llm", 1), part="llm")
    assert cache.get("a", "d1", lambda: build("a-llm", 1), part="llm") is a
    flow = cache.get("a", "d1", lambda: build("a-flow", 1))  # same voice and digest, the other part
    assert flow is not a and builds == ["a-llm", "a-flow"]
    cache.get("b", "d1", lambda: build("b-llm", 1.5), part="llm")  # 3.5 MiB: the least recently used goes
    assert cache.nbytes <= 3 * MIB and cache.stats.evictions == 1
    cache.get("a", "d1", lambda: build("a-llm", 1), part="llm")
    assert builds[-1] == "a-llm" and builds.count("a-llm") == 2  # a's LLM entry was the one evicted
    cache.get("a", "d2", lambda: build("a2-llm", 0.5), part="llm")  # another transcript, another key
    assert builds[-1] == "a2-llm"
    assert cache.get("big", "d1", lambda: build("big", 4), part="llm") is None and cache.stats.too_big == 1
    assert cache.part_nbytes("llm") + cache.part_nbytes("flow") == cache.nbytes <= 3 * MIB


def test_a_reloaded_engine_starts_without_llm_prefixes(voice_bundle: Path) -> None:  # noqa: F811
    eng = load_synthesizer(voice_bundle, settings=SynthesisSettings(overlap_stages=False, voice_cache_mb=64))
    request = SynthesisRequest(text="x", mode="zero_shot", voice="alice")
    try:
        eng.warm_voice(request)
        assert eng.voice_cache.part_nbytes("llm") > 0
    finally:
        eng.close()
    assert eng.voice_cache.nbytes == 0
    again = load_synthesizer(voice_bundle, settings=SynthesisSettings(overlap_stages=False))
    try:
        assert again.voice_cache.part_nbytes("llm") == 0
        assert again.llm_prefix(again.conditioning.build(request), "zero_shot") is not None
        assert again.voice_cache.stats.builds == 1
    finally:
        again.close()


def one_position_bundle(src: Path, out: Path) -> Path:
    """`src` as bundles were exported before: llm_decode declares inputs_embeds [B, 1, D], P+1."""
    shutil.copytree(src, out)
    path = out / "llm_decode.onnx"
    model = onnx.load(str(path), load_external_data=False)
    renames = {"inputs_embeds": (1, 1), "attention_mask": (1, "P+1"), "present_kv": (4, "P+1")}
    for value in [*model.graph.input, *model.graph.output]:
        if value.name in renames:
            axis, dim = renames[value.name]
            d = value.type.tensor_type.shape.dim[axis]
            if isinstance(dim, int):
                d.dim_value = dim
            else:
                d.dim_param = dim
    onnx.save(model, str(path))
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["stages"]["llm_decode"]
    for spec in [*entry["inputs"], *entry["outputs"]]:
        if spec["name"] in renames:
            axis, dim = renames[spec["name"]]
            spec["shape"][axis] = dim
    # as exported then: one step profile, without T
    entry["profile"] = {k: v for k, v in entry["profile"][0].items() if k != "T"}
    entry["sha256"] = manifest["files"]["llm_decode.onnx"] = sha256_file(path)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def test_a_bundle_with_a_one_position_decode_runs_uncached(voice_bundle: Path, vengine: CosyVoiceSynthesizer,  # noqa: F811
                                                           tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    old = one_position_bundle(voice_bundle, tmp_path / "old")
    assert not load_bundle(old).llm_decode_positions
    with caplog.at_level(logging.INFO, logger="cosyedge_models.synthesis.synthesizer"):
        eng = load_synthesizer(old, settings=SynthesisSettings(overlap_stages=False))
    try:
        assert sum("LLM prefix cache off" in r.getMessage() for r in caplog.records) == 1
        assert not eng.lm.takes_prefix
        stats = record_stats(monkeypatch)
        tokens = record_tokens(monkeypatch)
        audio, _ = stream(eng, "zero_shot", cache_mb=256)
        reference, _ = stream(vengine, "zero_shot", cache_mb=0)
        assert tokens[0] and tokens[0] == tokens[1] and stats[0].prefix_positions == 0
        np.testing.assert_allclose(audio, reference, rtol=0, atol=ATOL)
        assert eng.voice_cache.part_nbytes("llm") == 0 and eng.voice_cache.part_nbytes("flow") > 0
        cond = eng.conditioning.build(SynthesisRequest(text="x", mode="zero_shot", voice="alice"))
        report = llm_prefix_report(eng, cond, TEXT, 1)  # what `bench --voice` writes for such a bundle
        assert report == {"llm_prefix": "off: this bundle's llm_decode takes one new position (re-export it)",
                          "llm_prefix_positions": 0}
        # the old graph really takes one position: a seeded prefill could not run on it
        with pytest.raises(SynthesisError):
            HostDecodeLoop(eng.lm.prefill_session, eng.lm.decode_session).prefill(
                np.zeros((1, 2, eng.bundle.llm.hidden_size), np.float32),
                np.zeros((eng.bundle.llm.num_layers, 2, 1, eng.bundle.llm.num_kv_heads, 3, eng.bundle.llm.head_dim),
                         np.float32))
    finally:
        eng.close()


@pytest.mark.gpu
def test_llm_prefix_parity_on_ort_cuda(tiny_bundle: Path) -> None:
    """The bound loop on the CUDA provider: the host prefix copied to the device per request."""
    require_cuda_provider()
    eng = load_synthesizer(tiny_bundle, settings=SynthesisSettings(backend="ort-cuda"))
    try:
        loop = eng.lm.decode_loop()
        assert isinstance(loop, BoundDecodeLoop) and loop.takes_past
        loop.close()
        assert_prefix_parity(eng.lm)
    finally:
        eng.close()


def test_bench_llm_only_voice_reports_the_llm_prefix(voice_bundle: Path, tmp_path: Path) -> None:  # noqa: F811
    from cosyedge_daemon.cli.main import main

    out = tmp_path / "llm.json"
    assert main(["bench", "--bundle", str(voice_bundle), "--voice", "alice", "--llm-only", "--repeats", "1",
                 "--concurrency", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    vc = r["voice_cache"]
    assert r["machine"] and r["voice"] == "alice" and r["concurrency"]["1"]["tokens"] > 0
    assert vc["llm_prefix"] == "on" and 0 < vc["llm_prefix_positions"] < vc["llm_prefill_positions"]
    assert len(vc["llm_first_chunk_on_runs_ms"]) == 3 and vc["same_tokens_off_on"] is True
    assert vc["llm_prefill_on_ms"] > 0 and vc["llm_prefill_max_abs_logp_diff"] <= ATOL
