"""The fixed-shape TensorRT engines, under the emulator (tests/support/trt_emulator) in
the default run or on a real GPU with TensorRT (conftest.py's trt_runtime): `build engines`
builds and records one engine per fixed-shape stage of the bundle with every CUDA-graph
stage (graph_bundle), the loader takes them, and their CUDA-graph replay
(models/backends/tensorrt/static_flow.py, tensorrt/static_vocoder.py,
tensorrt/static_encoder.py) gives what the dynamic TensorRT engines and onnxruntime on the
CPU give, within the tolerance of test_trt_backend.py, through slot reuse, a voice's
preloaded prefix, trims and the move to the dynamic engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cosyedge_models.backends.encoder_cache import EncoderCache, EncoderCacheSpec, HostEncoderCache
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.flow_cache import PrefixRows, StepCache, StepCacheSpec
from cosyedge_models.backends.graph_thread import GraphThread
from cosyedge_models.bundle.loader import (
    STAGES,
    STATIC_ENCODER_PREFIX,
    STATIC_FLOW_PREFIX,
    STATIC_VOCODER_PREFIX,
    Bundle,
    load_bundle,
)
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.flow import FlowDecoder, FlowPrompt
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.vocoder import HiftVocoder
from cosyedge_models.synthesis.voice_cache import build_flow_prefix

from tests.conftest import STATIC_FLOW_CACHE
from tests.models.flow_streams import stream_mel
from tests.support.module_tmp import ModuleTmp
from tests.support.trt_emulator import Emulation
from tests.support.trt_runtime import build_trt_bundle

TOL = 2e-2  # relative, as test_trt_backend.py's stage checks (TF32 / other tactics per shape)


@pytest.fixture(scope="module")
def trt_graph_bundle(trt_runtime: Emulation | None, graph_bundle: Path,
                     module_tmp: ModuleTmp) -> Path:
    return build_trt_bundle(graph_bundle, module_tmp.mktemp("trt-static") / "bundle")


def _fixed(bundle: Bundle, prefix: str) -> list[str]:
    return sorted(n for n in bundle.stages if n.startswith(prefix))


def test_fixed_shape_engines_are_built_recorded_and_loaded(trt_graph_bundle: Path) -> None:
    manifest = json.loads((trt_graph_bundle / "manifest.json").read_text())
    fixed = sorted(n for n in manifest["stages"] if n.startswith((STATIC_FLOW_PREFIX, STATIC_VOCODER_PREFIX)))
    assert fixed and set(manifest["engines"]["stages"]) >= set(STAGES) | set(fixed)
    for name in fixed:  # one profile with min = opt = max: every input static
        (profile,) = manifest["engines"]["stages"][name]["profiles"]
        assert all(lo == opt == hi for lo, opt, hi in profile.values())
    bundle = load_bundle(trt_graph_bundle, backend="trt")
    assert all(bundle.stages[n].path.suffix == ".plan" for n in fixed)


def _prompt(bundle: Bundle, tokens: int = 12) -> FlowPrompt:
    rng = np.random.default_rng(4)
    return FlowPrompt(tokens=np.arange(tokens, dtype=np.int64) % 50,
                      embedding=rng.standard_normal(192).astype(np.float32),
                      feat=rng.standard_normal((2 * tokens, bundle.mel_bins)).astype(np.float32))


def noise(seed: int) -> np.random.Generator:
    """The vocoder's random source, the same draws for every runtime compared."""
    return np.random.default_rng(seed)


def _close_to(got: np.ndarray, want: np.ndarray, what: str) -> None:
    scale = float(np.abs(want).max()) + 1e-6
    err = float(np.abs(got.astype(np.float64) - want).max()) / scale
    assert err < TOL, f"{what}: relative error {err}"


@pytest.mark.parametrize(("n_tokens", "left"), [(60, -1), (190, -1), (190, 2)],
                         ids=["fits", "moves-to-dynamic", "left-2-trims"])
def test_static_flow_engines_match_the_dynamic_engine_and_onnxruntime(trt_graph_bundle: Path, n_tokens: int,
                                                                      left: int) -> None:
    from cosyedge_models.backends.tensorrt.backend import TrtBackend
    from cosyedge_models.backends.tensorrt.flow_cache import TrtStepCache
    from cosyedge_models.backends.tensorrt.session import TrtSession
    from cosyedge_models.backends.tensorrt.static_flow import TrtStaticFlow, TrtStaticStepCache

    bundle = load_bundle(trt_graph_bundle, backend="trt")
    trt = TrtBackend()
    enc = trt.load("flow_encoder", bundle.stages["flow_encoder"].path)
    est = trt.load("flow_estimator", bundle.stages["flow_estimator"].path)
    statics = [trt.load(n, bundle.stages[n].path) for n in _fixed(bundle, STATIC_FLOW_PREFIX)]
    assert all(isinstance(s, TrtSession) for s in statics)
    prompt = _prompt(bundle)
    toks = np.random.default_rng(3).integers(0, bundle.llm.speech_token_size, n_tokens)
    dynamic = stream_mel(FlowDecoder(bundle, enc, est, trt.flow_cache), prompt, toks, left)
    ort_bundle = load_bundle(trt_graph_bundle)
    ort = create_backend("ort")
    reference = stream_mel(FlowDecoder(ort_bundle, ort.load("flow_encoder", ort_bundle.stages["flow_encoder"].path),
                                    ort.load("flow_estimator", ort_bundle.stages["flow_estimator"].path),
                                    ort.flow_cache), prompt, toks, left)
    _close_to(dynamic, reference, "dynamic TensorRT vs onnxruntime")
    with GraphThread() as thread:
        flow = TrtStaticFlow(statics, 2 * bundle.flow.n_timesteps, thread)
        flow.warm_up()
        assert flow.disabled is None, flow.disabled
        assert flow.capture  # the tiny estimator's engines capture (a refusal would only warn)
        assert flow.cache_frames == STATIC_FLOW_CACHE
        made: list[StepCache] = []

        def factory(session: Any, spec: StepCacheSpec) -> StepCache:
            made.append(flow(session, spec))
            return made[-1]

        # the second stream reuses the slots (and their captured graphs), also those given back
        # by a move to the dynamic engine: with their conv history zeroed
        for _ in range(2):
            made.clear()
            static = stream_mel(FlowDecoder(bundle, enc, est, factory), prompt, toks, left)
            _close_to(static, dynamic, "static vs dynamic TensorRT")
            _close_to(static, reference, "static TensorRT vs onnxruntime")
            assert made and all(isinstance(c, TrtStaticStepCache) for c in made)
        assert flow.replays > 0
        spec = FlowDecoder(bundle, enc, est, factory).cache_spec()
        taken = [flow(est, spec) for _ in range(2 * bundle.flow.n_timesteps)]
        beyond = flow(est, spec)  # the pool is empty: the dynamic engine from the start
        assert isinstance(beyond, TrtStepCache) and all(isinstance(c, TrtStaticStepCache) for c in taken)
        for c in (*taken, beyond):
            c.close()
        flow.close()


def test_a_voice_prefix_is_preloaded_into_the_slot_and_a_full_cache_moves(trt_graph_bundle: Path) -> None:
    """preload: the saved rows by device copy; the calls then stay on the fixed shapes, giving
    what a TrtStepCache preloaded from the host gives, until the cache is full and they move."""
    from cosyedge_models.backends.tensorrt.backend import TrtBackend
    from cosyedge_models.backends.tensorrt.static_flow import TrtStaticFlow, TrtStaticStepCache

    bundle = load_bundle(trt_graph_bundle, backend="trt")
    trt = TrtBackend()
    est = trt.load("flow_estimator", bundle.stages["flow_estimator"].path)
    enc = trt.load("flow_encoder", bundle.stages["flow_encoder"].path)
    statics = [trt.load(n, bundle.stages[n].path) for n in _fixed(bundle, STATIC_FLOW_PREFIX)]
    spec = FlowDecoder(bundle, enc, est, trt.flow_cache).cache_spec()
    rng = np.random.default_rng(7)
    rows = PrefixRows((0.1 * rng.standard_normal((30, *spec.row))).astype(np.float32))
    conv = (0.1 * rng.standard_normal(spec.conv)).astype(np.float32)
    window = min(int(n.removeprefix(STATIC_FLOW_PREFIX)) for n in _fixed(bundle, STATIC_FLOW_PREFIX))
    c, f = bundle.mel_bins, window - 10
    feeds: dict[str, np.ndarray] = {
             "x": rng.standard_normal((2, c, f)).astype(np.float32), "mask": np.ones((2, 1, f), np.float32),
             "mu": rng.standard_normal((2, c, f)).astype(np.float32), "t": np.full((2,), 0.3, np.float32),
             "spks": rng.standard_normal((2, c)).astype(np.float32),
             "cond": rng.standard_normal((2, c, f)).astype(np.float32),
             "chunk_frames": np.full((2,), bundle.flow.chunk_tokens * bundle.token_mel_ratio, np.int64),
             "commit": np.zeros((20,), np.float32)}
    with GraphThread() as thread:
        flow = TrtStaticFlow(statics, 2, thread)
        flow.warm_up()
        static, dynamic = flow(est, spec), trt.flow_cache(est, spec)
        assert isinstance(static, TrtStaticStepCache)
        for cache in (static, dynamic):
            cache.preload(rows, conv)
        fits = (STATIC_FLOW_CACHE - 30) // 20
        for step in range(fits + 1):  # the last call's rows do not fit: the move, by device copy, then that call
            _close_to(static.run(feeds, 20), dynamic.run(feeds, 20), f"call {step} after a preloaded prefix")
            assert static.on_graph == (step < fits)
        assert static.length == dynamic.length == 30 + (fits + 1) * 20 and flow.moves == 1
        for cache in (static, dynamic):
            cache.close()
        flow.close()


@pytest.mark.parametrize(("n_tokens", "prompt_tokens", "hop", "moves"),
                         [(60, 12, 25, 0), (50, 60, 25, 0), (190, 12, 25, 1), (120, 12, 90, 1)],
                         ids=["fits", "voice-prefix", "cache-outgrown-moves", "window-too-long-moves"])
def test_static_encoder_engines_match_host_caches_on_onnxruntime(trt_graph_bundle: Path, n_tokens: int,
                                                                 prompt_tokens: int, hop: int, moves: int) -> None:
    """The encoder windows' engines (tensorrt/static_encoder.py) against HostEncoderCache over
    onnxruntime's CPU graphs: the same mel through a stream that fits, one seeded from a voice's
    prefix (by device copy), and ones whose cache (190 tokens over 160) or first window (a
    90-token hop, over the largest bucket) does not fit and move once to the dynamic engine."""
    from cosyedge_models.backends.tensorrt.backend import TrtBackend
    from cosyedge_models.backends.tensorrt.session import TrtSession
    from cosyedge_models.backends.tensorrt.static_encoder import TrtStaticEncoder, TrtStaticEncoderCache

    bundle = load_bundle(trt_graph_bundle, backend="trt")
    trt = TrtBackend()
    enc = trt.load("flow_encoder", bundle.stages["flow_encoder"].path)
    est = trt.load("flow_estimator", bundle.stages["flow_estimator"].path)
    statics = [trt.load(n, bundle.stages[n].path) for n in _fixed(bundle, STATIC_ENCODER_PREFIX)]
    assert statics and all(isinstance(s, TrtSession) for s in statics)
    prompt = _prompt(bundle, prompt_tokens)
    toks = np.random.default_rng(3).integers(0, bundle.llm.speech_token_size, n_tokens)
    ort_bundle = load_bundle(trt_graph_bundle)
    ort = create_backend("ort")
    host = FlowDecoder(ort_bundle, ort.load("flow_encoder", ort_bundle.stages["flow_encoder"].path),
                       ort.load("flow_estimator", ort_bundle.stages["flow_estimator"].path))
    prefix = build_flow_prefix(host, prompt) if prompt_tokens > 12 else None
    assert (prefix is not None) == (prompt_tokens > 12)
    reference = stream_mel(host, prompt, toks, prefix=prefix, hop=hop)
    spec = host.encoder_spec
    with GraphThread() as thread:
        graphs = TrtStaticEncoder(statics, spec, 2, thread)
        graphs.warm_up()
        assert graphs.disabled is None, graphs.disabled
        assert graphs.capture  # the tiny encoder's engines capture (a refusal would only warn)
        assert graphs.cache_tokens == STATIC_FLOW_CACHE // 2
        made: list[EncoderCache] = []

        def factory(session: Any, spec: EncoderCacheSpec) -> EncoderCache:
            made.append(graphs(session, spec))
            return made[-1]

        decoder = FlowDecoder(bundle, enc, est, trt.flow_cache, factory)
        for run in range(2):  # the second stream reuses the slot, its graphs and the prefix's device copy
            made.clear()
            static = stream_mel(decoder, prompt, toks, prefix=prefix, hop=hop)
            assert static.shape == reference.shape == (1, bundle.mel_bins, 2 * n_tokens)
            _close_to(static, reference, f"static TensorRT encoder vs onnxruntime host caches, stream {run}")
            assert len(made) == 1 and isinstance(made[0], TrtStaticEncoderCache)
        assert graphs.moves == 2 * moves
        assert (graphs.replays > 0) == (hop == 25)  # a too-long first window never replays
        taken = [graphs(enc, spec) for _ in range(2)]
        beyond = graphs(enc, spec)  # the pool is empty: the dynamic engine from the start
        other = graphs(enc, EncoderCacheSpec(spec.dims, spec.chunk_tokens + 1, spec.token_mel_ratio))
        assert all(isinstance(c, TrtStaticEncoderCache) for c in taken)
        assert isinstance(beyond, HostEncoderCache) and isinstance(other, HostEncoderCache)
        for c in (*taken, beyond, other):
            c.close()
        graphs.close()


def test_static_vocoder_engines_match_the_dynamic_engines_and_onnxruntime(trt_graph_bundle: Path) -> None:
    from cosyedge_models.backends.tensorrt.backend import TrtBackend
    from cosyedge_models.backends.tensorrt.static_vocoder import TrtStaticVocoder

    bundle = load_bundle(trt_graph_bundle, backend="trt")
    trt = TrtBackend()
    source, decoder = (trt.load(n, bundle.stages[n].path) for n in ("hift_source", "hift_decoder"))
    statics = [trt.load(n, bundle.stages[n].path) for n in _fixed(bundle, STATIC_VOCODER_PREFIX)]
    ort_bundle = load_bundle(trt_graph_bundle)
    ort = create_backend("ort")
    reference = HiftVocoder(ort_bundle, ort.load("hift_source", ort_bundle.stages["hift_source"].path),
                            ort.load("hift_decoder", ort_bundle.stages["hift_decoder"].path))
    with GraphThread() as thread:
        static = TrtStaticVocoder(statics, thread)
        static.warm_up()
        assert static.disabled is None and static.capture and static.frames
        plain = HiftVocoder(bundle, source, decoder)
        fixed = HiftVocoder(bundle, source, decoder, static)
        rng = np.random.default_rng(0)
        cache = (0.3 * rng.standard_normal((1, 1, plain.source_cache_len))).astype(np.float32)
        for frames in static.frames:
            mel = rng.standard_normal((1, plain.mel_bins, frames)).astype(np.float32)
            for prev in (None, cache):
                before = static.replays
                got = fixed.run(mel, noise(frames), prev)
                assert static.replays == before + 1
                for want in (plain.run(mel, noise(frames), prev), reference.run(mel, noise(frames), prev)):
                    _close_to(got[0], want[0], f"audio of {frames} frames")
                    _close_to(got[1], want[1], f"source of {frames} frames")
        odd = rng.standard_normal((1, plain.mel_bins, static.frames[0] + 3)).astype(np.float32)
        before = static.replays
        fixed.run(odd, noise(1), None)
        assert static.replays == before  # no engine of that length: the dynamic ones
        static.close()


def test_pipeline_on_trt_with_the_fixed_shape_engines(trt_graph_bundle: Path) -> None:
    """The engine on backend trt loads them (graph_flow, the encoder's with it, and graph_vocoder
    auto), replays them, and its audio stays within the trt tolerance of the dynamic engines'."""
    from cosyedge_models.backends.tensorrt.static_encoder import TrtStaticEncoder
    from cosyedge_models.backends.tensorrt.static_flow import TrtStaticFlow
    from cosyedge_models.backends.tensorrt.static_vocoder import TrtStaticVocoder
    from cosyedge_models.synthesis.synthesizer import load_synthesizer

    req = SynthesisRequest(text="Hello from the board, with fixed shapes.", seed=5, stream=True)
    out = {}
    for on in (None, False):
        settings = SynthesisSettings(backend="trt", graph_flow=on, graph_vocoder=on, overlap_stages=False)
        engine = load_synthesizer(trt_graph_bundle, "trt", settings)
        try:
            if on is None:
                assert isinstance(engine.static_flow, TrtStaticFlow) and engine.static_flow.disabled is None
                assert isinstance(engine.static_vocoder, TrtStaticVocoder)
                assert isinstance(engine.static_encoder, TrtStaticEncoder) and engine.static_encoder.disabled is None
            else:
                assert engine.static_flow is None and engine.static_vocoder is None and engine.static_encoder is None
            out[on] = np.concatenate([c.pcm for c in engine.synthesize(req)])
            if on is None:
                assert engine.static_flow is not None and engine.static_flow.replays > 0
                assert engine.static_vocoder is not None and engine.static_vocoder.replays > 0
                assert engine.static_encoder is not None and engine.static_encoder.replays > 0
        finally:
            engine.close()
    assert out[None].shape == out[False].shape
    _close_to(out[None], out[False], "audio with and without the fixed-shape engines")
