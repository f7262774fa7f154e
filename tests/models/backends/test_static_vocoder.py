"""The fixed-length vocoder graphs (build export --static-vocoder) and their
replay (models/backends/ort_static_vocoder.py): only static shapes, no shape
arithmetic left for the host, what the dynamic hift_source + hift_decoder
pair computes with the runtime's source cache in between, the engine's audio
unchanged, other lengths on the dynamic sessions. On the CPU without
capture; `-m gpu` with CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.graph_thread import GraphThread
from cosyedge_models.backends.ort import OrtBackend
from cosyedge_models.backends.ort_static_vocoder import StaticVocoder
from cosyedge_models.bundle.loader import STATIC_VOCODER_PREFIX, load_bundle
from cosyedge_models.errors import BundleError
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer
from cosyedge_models.synthesis.vocoder import HiftVocoder

from tests.conftest import STATIC_VOCODER_FIRST_HOP, STATIC_VOCODER_LATER_HOP
from tests.support.components import require_cuda_provider


def _names(bundle_dir: Path) -> list[str]:
    return sorted(n for n in load_bundle(bundle_dir).stages if n.startswith(STATIC_VOCODER_PREFIX))


def test_graphs_cover_the_recurring_chunk_lengths(graph_bundle: Path) -> None:
    """Hand-computed from upstream CosyVoice 2's streaming (cosyvoice/cli/model.py, CosyVoice2Model):
    a stream of a prompt-less voice gives the vocoder first 25 tokens x 2 mel frames per token = 50
    frames, then each hop's 50 frames after the 8 kept frames of the previous chunk (mel_cache_len)
    = 58; the tiny bundle keeps upstream's streaming numbers. graph_bundle also asked for a first
    hop of 15 tokens (`--static-vocoder-first-hops 15`): its first chunk, 15 x 2 = 30 frames; and a
    later hop of 50 (`--static-vocoder-hops 50`): its steady chunk, 50 x 2 + 8 = 108, and an offline
    request's first chunk there, 50 x 2 = 100."""
    bundle = load_bundle(graph_bundle)
    s = bundle.streaming
    assert (s.token_hop_len, bundle.token_mel_ratio, s.mel_cache_len) == (25, 2, 8)
    assert (STATIC_VOCODER_FIRST_HOP, STATIC_VOCODER_LATER_HOP) == (15, 50)
    assert set(_names(graph_bundle)) == {f"{STATIC_VOCODER_PREFIX}{n}" for n in (30, 50, 58, 100, 108)}


def test_first_hops_need_the_fixed_length_graphs(tiny_model_dir: Path, tmp_path: Path) -> None:
    from cosyedge_build.export import export_bundle

    for fixed, hops in ((False, (15,)), (True, (0,))):
        with pytest.raises(ValueError, match=r"--static-vocoder-first-hops\) need --static-vocoder and hops >= 1"):
            export_bundle(tiny_model_dir, tmp_path / "bundle", static_vocoder=fixed, static_vocoder_first_hops=hops)
        assert not (tmp_path / "bundle").exists()  # refused before any export work
        with pytest.raises(ValueError, match=r"--static-vocoder-hops\) need --static-vocoder and hops >= 1"):
            export_bundle(tiny_model_dir, tmp_path / "bundle", static_vocoder=fixed, static_vocoder_hops=hops)
        assert not (tmp_path / "bundle").exists()


def test_graphs_have_only_fixed_shapes(graph_bundle: Path, tmp_path: Path) -> None:
    for name in _names(graph_bundle):
        path = load_bundle(graph_bundle).stages[name].path
        model = onnx.load(str(path))
        for value in [*model.graph.input, *model.graph.output]:
            assert all(d.HasField("dim_value") for d in value.type.tensor_type.shape.dim), (name, value.name)
        opts = ort.SessionOptions()  # what onnxruntime leaves after constant folding
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.optimized_model_filepath = str(tmp_path / f"{name}.opt.onnx")
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        ops = {n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node}
        # shape arithmetic is what onnxruntime moves to the CPU (and what blocks capture)
        assert not ops & {"Shape", "Size", "NonZero", "Range", "ConstantOfShape"}, (name, ops)


def _vocoders(bundle_dir: Path, device: str) -> tuple[HiftVocoder, HiftVocoder, StaticVocoder, GraphThread]:
    bundle = load_bundle(bundle_dir)
    backend = create_backend("ort" if device == "cpu" else "ort-cuda")
    assert isinstance(backend, OrtBackend)
    load = {n: backend.load(n, bundle.stages[n].path, threads=1) for n in ("hift_source", "hift_decoder",
                                                                        *_names(bundle_dir))}
    thread = GraphThread().start()
    statics = [load[n] for n in _names(bundle_dir)]
    static = StaticVocoder(statics, ("cpu", 0) if device == "cpu" else ("cuda", 0), thread)  # type: ignore[arg-type]
    static.warm_up()
    plain = HiftVocoder(bundle, load["hift_source"], load["hift_decoder"])
    fixed = HiftVocoder(bundle, load["hift_source"], load["hift_decoder"], static)
    return plain, fixed, static, thread


class _Noise:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def standard_normal(self, size: tuple[int, ...], dtype: type[np.float32]) -> np.ndarray:
        return self.rng.standard_normal(size).astype(dtype)


def _compare(bundle_dir: Path, device: str, atol: float) -> None:
    plain, fixed, static, thread = _vocoders(bundle_dir, device)
    try:
        assert static.disabled is None
        rng = np.random.default_rng(0)
        cache = (0.3 * rng.standard_normal((1, 1, plain.source_cache_len))).astype(np.float32)
        for frames in static.frames:
            mel = rng.standard_normal((1, plain.mel_bins, frames)).astype(np.float32)
            for prev in (None, cache):  # the first chunk, a later one with the source cache
                want_audio, want_source = plain.run(mel, _Noise(frames), prev)
                before = static.replays
                audio, source = fixed.run(mel, _Noise(frames), prev)
                assert static.replays == before + 1
                np.testing.assert_allclose(source, want_source, atol=atol, rtol=atol)
                np.testing.assert_allclose(audio, want_audio, atol=atol, rtol=atol)
        odd = rng.standard_normal((1, plain.mel_bins, static.frames[0] + 3)).astype(np.float32)
        before = static.replays  # a length without a graph: the dynamic sessions
        got, want = fixed.run(odd, _Noise(1), None)[0], plain.run(odd, _Noise(1), None)[0]
        if device == "cpu":
            np.testing.assert_array_equal(got, want)
        else:  # two runs of one CUDA session may pick different convolution kernels (measured: 2e-8 apart)
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
        assert static.replays == before
    finally:
        thread.close()


def test_fixed_length_graphs_match_the_dynamic_pair(graph_bundle: Path) -> None:
    _compare(graph_bundle, "cpu", 1e-5)


@pytest.mark.gpu
def test_captured_fixed_length_graphs_match_the_dynamic_pair(graph_bundle: Path) -> None:
    require_cuda_provider()
    _compare(graph_bundle, "cuda", 5e-3)  # different kernels per shape, TF32


def test_engine_audio_is_unchanged_with_the_fixed_length_graphs(graph_bundle: Path) -> None:
    req = SynthesisRequest(text="Hello from the tiny model, one two three, and a few more words.", seed=3,
                           stream=True)
    out = {}
    for on in (False, True):
        # the last chunk at its exact length (vocoder_pad_final off: test_vocoder_pad_final.py)
        eng = load_synthesizer(graph_bundle, settings=SynthesisSettings(backend="ort", graph_vocoder=on,
                                                                        overlap_stages=False,
                                                                        vocoder_pad_final=False))
        try:
            out[on] = np.concatenate([c.pcm for c in eng.synthesize(req)])
            if on:
                assert eng.static_vocoder is not None and eng.static_vocoder.replays >= 2
            else:
                assert eng.static_vocoder is None
        finally:
            eng.close()
    np.testing.assert_allclose(out[True], out[False], atol=1e-5)


def test_forcing_it_needs_the_graphs_and_auto_is_off_on_the_cpu(tiny_bundle: Path, graph_bundle: Path) -> None:
    with pytest.raises(BundleError, match="--static-vocoder"):
        load_synthesizer(tiny_bundle, settings=SynthesisSettings(backend="ort", graph_vocoder=True))
    eng = load_synthesizer(graph_bundle, settings=SynthesisSettings(backend="ort"))
    try:
        assert eng.static_vocoder is None
    finally:
        eng.close()
