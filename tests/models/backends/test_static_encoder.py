"""The fixed-shape streaming flow encoder graphs (exported with
--static-flow-windows, edge_build/export/flow_encoder_static.py) and their replay
(models/backends/ort_static_encoder.py): only static shapes, a stream through
them gives the dynamic graph's mu and mel, a voice's prefix is seeded into the
slot, windows and caches that do not fit move to the host caches exactly, slots
are reused. On the CPU they run without capture; `-m gpu` runs them with CUDA graphs."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cosyedge_models.backends.encoder_cache import EncoderCache, EncoderCacheSpec, HostEncoderCache
from cosyedge_models.backends.graph_thread import GraphThread
from cosyedge_models.backends.ort_cache import DeviceCopier
from cosyedge_models.backends.ort_static_encoder import StaticEncoderCache, StaticEncoderGraphs
from cosyedge_models.bundle.loader import STATIC_ENCODER_PREFIX, Bundle, load_bundle
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.flow import FlowDecoder, FlowPrompt
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer
from cosyedge_models.synthesis.voice_cache import build_flow_prefix

from tests.conftest import STATIC_FLOW_CACHE, STATIC_FLOW_WINDOWS
from tests.models.flow_streams import Recording, flow_sessions, stream_mel
from tests.support.components import require_cuda_provider


def _prompt(bundle: Bundle, tokens: int = 12) -> FlowPrompt:
    return FlowPrompt(tokens=np.arange(tokens, dtype=np.int64) % 50,
                      feat=np.random.default_rng(1).standard_normal((2 * tokens, bundle.mel_bins)).astype(np.float32),
                      embedding=np.random.default_rng(2).standard_normal(192).astype(np.float32))


def _compare(bundle_dir: Path, device: str, n_tokens: int, slots: int = 2, prompt_tokens: int = 12,
             prime: bool = False, hop: int = 25) -> tuple[StaticEncoderGraphs, list[EncoderCache]]:
    """A stream with the static encoder against one with the host caches (the dynamic graph)."""
    sessions, bundle = flow_sessions(bundle_dir, device, STATIC_ENCODER_PREFIX)
    statics = [s for n, s in sessions.items() if n.startswith(STATIC_ENCODER_PREFIX)]
    enc, est = sessions["flow_encoder"], sessions["flow_estimator"]
    prompt = _prompt(bundle, prompt_tokens)
    toks = np.random.default_rng(3).integers(0, bundle.llm.speech_token_size, n_tokens)
    try:
        with GraphThread() as thread:
            host = FlowDecoder(bundle, enc, est)
            graphs = StaticEncoderGraphs(statics, (device, 0), DeviceCopier(device), host.encoder_spec, slots,
                                         thread)
            graphs.warm_up()
            assert graphs.capture == (device == "cuda") and graphs.disabled is None
            prefix = build_flow_prefix(host, prompt) if prime else None
            dynamic = stream_mel(host, prompt, toks, prefix=prefix, hop=hop)
            rec: Recording[EncoderCache] = Recording(graphs)
            static = stream_mel(FlowDecoder(bundle, enc, est, encoder_cache_factory=rec), prompt, toks, prefix=prefix,
                                hop=hop)
    finally:
        for s in sessions.values():
            s.close()
    assert static.shape == dynamic.shape == (1, bundle.mel_bins, 2 * n_tokens)
    # exact on the CPU up to summation order; TF32 kernels on a GPU (as the estimator's graphs)
    np.testing.assert_allclose(static, dynamic, rtol=0, atol=1e-5 if device == "cpu" else 5e-3)
    return graphs, rec.made


def test_encoder_graphs_have_only_fixed_shapes(static_flow_bundle: Path) -> None:
    bundle = load_bundle(static_flow_bundle)
    names = sorted(n for n in bundle.stages if n.startswith(STATIC_ENCODER_PREFIX))
    look = bundle.flow.pre_lookahead_len
    # one encoder window per estimator window: tokens = frames / ratio + look-ahead
    assert names == sorted(f"{STATIC_ENCODER_PREFIX}{w // 2 + look}" for w in STATIC_FLOW_WINDOWS)
    for name in names:
        path = bundle.stages[name].path
        model = onnx.load(str(path), load_external_data=False)
        for value in [*model.graph.input, *model.graph.output]:
            assert all(d.HasField("dim_value") for d in value.type.tensor_type.shape.dim), (name, value.name)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.optimized_model_filepath = str(path.parent / f"opt-{name}.onnx.tmp")
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        ops = {n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node}
        Path(opts.optimized_model_filepath).unlink()
        assert not ops & {"Shape", "Size", "NonZero", "Range", "ConstantOfShape"}, ops  # nothing left to the CPU
        entry = bundle.stages[name].raw
        assert entry["cache_tokens"] == STATIC_FLOW_CACHE // 2 and entry["chunk_tokens"] == bundle.flow.chunk_tokens


def test_static_encoder_stream_matches_the_dynamic_graph(static_flow_bundle: Path) -> None:
    """60 tokens: every window fits a bucket and the caches stay within the slot."""
    graphs, made = _compare(static_flow_bundle, "cpu", 60)
    assert len(made) == 1 and isinstance(made[0], StaticEncoderCache)
    assert graphs.moves == 0 and graphs.replays >= 2


def test_a_voice_prefix_is_seeded_into_the_slot(static_flow_bundle: Path) -> None:
    """A 60-token prompt: its complete chunks come from the voice's prefix (built on the
    host) and the stream goes on on the fixed shapes, with the same mel."""
    graphs, made = _compare(static_flow_bundle, "cpu", 50, prompt_tokens=60, prime=True)
    assert graphs.moves == 0 and graphs.replays > 0 and isinstance(made[0], StaticEncoderCache)


def test_caches_and_windows_that_do_not_fit_move_exactly(static_flow_bundle: Path) -> None:
    """190 tokens outgrow the slot's 160 cached tokens midway; a hop of 90 tokens makes a
    window longer than the largest bucket at once. Both move, once, to the host caches."""
    graphs, _ = _compare(static_flow_bundle, "cpu", 190)
    assert graphs.moves == 1 and graphs.replays > 0
    graphs, _ = _compare(static_flow_bundle, "cpu", 120, hop=90)
    assert graphs.moves == 1 and graphs.replays == 0  # the first window (105 tokens) is over the largest


def test_graph_encoder_off_keeps_the_dynamic_encoder(static_flow_bundle: Path) -> None:
    eng = load_synthesizer(static_flow_bundle, "ort", SynthesisSettings(backend="ort", graph_flow=True,
                                                                        graph_encoder=False, overlap_stages=False))
    try:
        assert eng.static_flow is not None and eng.static_encoder is None
        assert set(eng.graphs.load_seconds) == {"flow"}
        list(eng.synthesize(SynthesisRequest(text="Only the estimator's graphs.", seed=1, stream=True)))
        assert eng.static_flow.replays > 0
    finally:
        eng.close()


def test_requests_beyond_the_slots_use_host_caches(static_flow_bundle: Path) -> None:
    sessions, bundle = flow_sessions(static_flow_bundle, "cpu", STATIC_ENCODER_PREFIX)
    statics = [s for n, s in sessions.items() if n.startswith(STATIC_ENCODER_PREFIX)]
    spec = FlowDecoder(bundle, sessions["flow_encoder"], sessions["flow_estimator"]).encoder_spec
    with GraphThread() as thread:
        graphs = StaticEncoderGraphs(statics, ("cpu", 0), DeviceCopier("cpu"), spec, 2, thread)
        graphs.warm_up()
        a, b, c = (graphs(sessions["flow_encoder"], spec) for _ in range(3))
        assert isinstance(a, StaticEncoderCache) and isinstance(b, StaticEncoderCache)
        assert isinstance(c, HostEncoderCache)
        a.close()
        d = graphs(sessions["flow_encoder"], spec)
        assert isinstance(d, StaticEncoderCache)  # the slot came back
        other = EncoderCacheSpec(spec.dims, spec.chunk_tokens + 1, spec.token_mel_ratio)
        assert isinstance(graphs(sessions["flow_encoder"], other), HostEncoderCache)  # another chunk: not baked in
        for x in (b, c, d):
            x.close()
    for s in sessions.values():
        s.close()


def test_engine_uses_the_static_encoder_with_unchanged_audio(static_flow_bundle: Path, tmp_path: Path) -> None:
    """graph_flow on: the estimator's and the encoder's graphs serve a saved voice's
    stream (prefix seeded into both), with the audio of graph_flow off."""
    import soundfile as sf
    from cosyedge_daemon.cli.voice import add_voice

    from tests.models.synthesis.test_synthesizer import prompt_audio

    bundle = tmp_path / "b"
    shutil.copytree(static_flow_bundle, bundle)
    prompt = prompt_audio(4.0, 22050)
    sf.write(tmp_path / "v.wav", prompt.pcm, prompt.sample_rate)
    add_voice(bundle, "v", tmp_path / "v.wav", "Hello, this is a saved voice speaking.")
    req = SynthesisRequest(text="Hi there, a static encoder.", mode="zero_shot", voice="v", seed=3, stream=True)
    outs = {}
    for on in (False, True):
        eng = load_synthesizer(bundle, "ort", SynthesisSettings(backend="ort", graph_flow=on, overlap_stages=False))
        try:
            assert (eng.static_encoder is not None) == on
            # each graph stage's load (slots made, graphs run or captured) is timed for bench and the log
            assert set(eng.graphs.load_seconds) == ({"flow", "encoder"} if on else set())
            for _ in range(2):  # the second request finds the voice's prefix built
                outs[on] = np.concatenate([c.pcm for c in eng.synthesize(req)])
            if on:
                assert eng.static_encoder is not None
                assert eng.static_encoder.replays > 0 and eng.static_encoder.moves == 0
        finally:
            eng.close()
    assert outs[True].shape == outs[False].shape
    np.testing.assert_allclose(outs[True], outs[False], rtol=0, atol=1e-4)


def _concurrent_engine_streams(bundle_dir: Path, tmp_path: Path, backend: str, n: int) -> None:
    """n saved-voice streams at once through one engine with the fixed-shape estimator and
    encoder graphs (one graph thread, slots for all): each one's audio equals the same
    request run alone, with the same calls on the fixed shapes."""
    import threading

    import soundfile as sf
    from cosyedge_daemon.cli.voice import add_voice

    from tests.models.synthesis.test_synthesizer import prompt_audio

    bundle = tmp_path / "b"
    shutil.copytree(bundle_dir, bundle)
    prompt = prompt_audio(4.0, 22050)
    sf.write(tmp_path / "v.wav", prompt.pcm, prompt.sample_rate)
    add_voice(bundle, "v", tmp_path / "v.wav", "Hello, this is a saved voice speaking.")
    texts = [f"Request number {i} says something a little longer each time." + " More." * i for i in range(n)]
    reqs = [SynthesisRequest(text=t, mode="zero_shot", voice="v", seed=10 + i, stream=True)
            for i, t in enumerate(texts)]
    eng = load_synthesizer(bundle, backend, SynthesisSettings(backend=backend, graph_flow=True, graph_flow_slots=n))
    try:
        assert eng.static_encoder is not None and eng.static_encoder.max_slots == n
        serial = [np.concatenate([c.pcm for c in eng.synthesize(r)]) for r in reqs]
        replays, moves = eng.static_encoder.replays, eng.static_encoder.moves  # the tiny cache fills: some move
        assert replays > 0
        out: dict[int, np.ndarray] = {}
        errors: list[BaseException] = []
        start = threading.Barrier(n)

        def one(i: int) -> None:
            try:
                start.wait()
                out[i] = np.concatenate([c.pcm for c in eng.synthesize(reqs[i])])
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors
        enc = eng.static_encoder
        assert enc.disabled is None
        # the same calls as alone: as many on the fixed shapes, the same moves
        assert enc.replays == 2 * replays and enc.moves == 2 * moves
    finally:
        eng.close()
    for i in range(n):
        assert out[i].shape == serial[i].shape
        np.testing.assert_allclose(out[i], serial[i], rtol=0, atol=1e-5 if backend == "ort" else 1e-3)


def test_concurrent_engine_streams_on_the_static_encoder(static_flow_bundle: Path, tmp_path: Path) -> None:
    _concurrent_engine_streams(static_flow_bundle, tmp_path, "ort", 3)


@pytest.mark.gpu
def test_cuda_graph_static_encoder_eight_concurrent_engine_streams(static_flow_bundle: Path, tmp_path: Path) -> None:
    require_cuda_provider()
    _concurrent_engine_streams(static_flow_bundle, tmp_path, "ort-cuda", 8)


@pytest.mark.gpu
def test_cuda_graph_static_encoder_matches_the_dynamic_graph(static_flow_bundle: Path) -> None:
    require_cuda_provider()
    graphs, _ = _compare(static_flow_bundle, "cuda", 60)
    assert graphs.capture and graphs.moves == 0
    graphs, _ = _compare(static_flow_bundle, "cuda", 50, prompt_tokens=60, prime=True)
    assert graphs.moves == 0 and graphs.replays > 0
    graphs, _ = _compare(static_flow_bundle, "cuda", 190)
    assert graphs.moves == 1
