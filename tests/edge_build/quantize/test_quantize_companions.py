"""`build quantize` on a bundle with the optional fixed-shape graphs (the
fixed-size decode step, the fixed-shape flow estimator graphs): they get the
bundle's precision like the stages they follow, the three LLM graphs share
one low-precision weight file, and the flow keeps one cache layout for the
fixed-shape and the dynamic estimator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cosyedge_build.export.shared_weights import LLM_STAGES as LLM_GRAPHS
from cosyedge_build.quantize.pipeline import quantize_bundle
from cosyedge_build.quantize.settings import AccuracyBudget, QuantizeSettings
from cosyedge_models.backends.ort import OrtBackend
from cosyedge_models.bundle.loader import STATIC_ENCODER_PREFIX, STATIC_FLOW_PREFIX, load_bundle
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer

from tests.models.backends.test_graph_decode import _compare_with_dynamic
from tests.support.module_tmp import ModuleTmp


@pytest.fixture(scope="module")
def fp16_graph_bundle(graph_bundle: Path, module_tmp: ModuleTmp) -> tuple[Path, dict[str, Any]]:
    out = module_tmp.mktemp("qc") / "b16"
    settings = QuantizeSettings(precision="fp16", calibration_size=4, held_out_size=2, feeds_per_stage=12,
                                budget=AccuracyBudget(e2e_match_min=0.0, llm_top1_min=0.85))
    return out, quantize_bundle(graph_bundle, out, settings)


def test_fixed_shape_graphs_get_the_bundle_precision(fp16_graph_bundle: tuple[Path, dict[str, Any]]) -> None:
    out, _ = fp16_graph_bundle
    bundle = load_bundle(out)
    statics = [n for n in bundle.stages if n.startswith(STATIC_FLOW_PREFIX)]
    assert bundle.precision == "fp16" and len(statics) == 2
    for name in ("llm_decode_static", *statics):
        assert bundle.stages[name].path.name == f"{name}.fp16.onnx" and bundle.stages[name].path.exists()
        assert bundle.stages[name].precision == "fp16"
    assert bundle.stages["llm_kv_pad"].precision == "fp32"  # no weights: not a companion
    # the encoder's fixed-shape graphs follow flow_encoder, which fp16 keeps in fp32
    encoders = [n for n in bundle.stages if n.startswith(STATIC_ENCODER_PREFIX)]
    assert len(encoders) == 2 and bundle.stages["flow_encoder"].precision == "fp32"
    assert all(bundle.stages[n].precision == "fp32" and bundle.stages[n].path.exists() for n in encoders)


def test_the_three_llm_graphs_share_one_fp16_weight_file(fp16_graph_bundle: tuple[Path, dict[str, Any]]) -> None:
    out, _ = fp16_graph_bundle
    index = json.loads((out / "llm_weights.fp16.json").read_text())
    assert sorted(index["graphs"]) == sorted(f"{g}.fp16.onnx" for g in LLM_GRAPHS)
    bundle = load_bundle(out)
    backend = OrtBackend(["CPUExecutionProvider"])
    sessions = [backend.load(g, bundle.stages[g].path, threads=1) for g in LLM_GRAPHS]
    try:
        assert all(s.shares_weights for s in sessions)
    finally:
        for s in sessions:
            s.close()


def test_fixed_size_fp16_step_matches_the_dynamic_fp16_step(fp16_graph_bundle: tuple[Path, dict[str, Any]]) -> None:
    # both in fp16 over the same weights; the graphs differ in how they mask and add (log-probs)
    _compare_with_dynamic(fp16_graph_bundle[0], "cpu", atol=5e-2, rtol=5e-2)


def test_flow_keeps_one_fp32_cache_for_both_estimators(fp16_graph_bundle: tuple[Path, dict[str, Any]]) -> None:
    out, _ = fp16_graph_bundle
    manifest = json.loads((out / "manifest.json").read_text())
    assert "fp16_io" not in manifest["stages"]["flow_estimator"]["variants"]["fp16"]
    eng = load_synthesizer(out, settings=SynthesisSettings(backend="ort", graph_flow=True, overlap_stages=False))
    try:
        assert eng.flow.cache_dtype == np.float32
        pcm = np.concatenate([c.pcm for c in eng.synthesize(SynthesisRequest(text="Hello there.", seed=2))])
        assert eng.static_flow is not None and eng.static_flow.replays > 0
    finally:
        eng.close()
    assert pcm.size > 0 and np.isfinite(pcm).all()


def test_weight_only_bundle_quantizes_the_fixed_size_step_too(graph_bundle: Path,
                                                              tmp_path: Path) -> None:
    settings = QuantizeSettings(precision="int8w", calibration_size=2, held_out_size=1, feeds_per_stage=4,
                                force=True)  # only the layout is checked here
    out = tmp_path / "b8w"
    quantize_bundle(graph_bundle, out, settings)
    bundle = load_bundle(out)
    assert bundle.stages["llm_decode_static"].path.name == "llm_decode_static.int8w.onnx"
    # flow_encoder is an always-fp32 stage, and its fixed-shape graphs follow it
    encoders = [n for n in bundle.stages if n.startswith(STATIC_ENCODER_PREFIX)]
    assert bundle.stages["flow_encoder"].precision == "fp32"
    assert encoders and all(bundle.stages[n].path.name == f"{n}.onnx" for n in encoders)
    index = json.loads((out / "llm_weights.int8w.json").read_text())
    assert sorted(index["graphs"]) == sorted(f"{g}.int8w.onnx" for g in LLM_GRAPHS)
    _compare_with_dynamic(out, "cpu", atol=1e-4, rtol=1e-4)  # the same int8 weights and kernels in both
