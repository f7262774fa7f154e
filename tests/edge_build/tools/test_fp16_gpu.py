"""The GPU fp16 bundle (edge_build/tools/device_fp16.py: the quantize pipeline's
fp16 conversion without its CPU accuracy run, the fixed-shape flow graphs
converted too, fp32 cache I/O): every fp16 graph, the fixed-shape ones
included, gives finite outputs on the calibration set (on the CPU here, on
the CUDA provider with `-m gpu`, where fp16 kernels really run in half
precision), and the bundle speaks with the fixed-shape flow graphs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from cosyedge_build.quantize.capture import capture_feeds
from cosyedge_build.quantize.finite import FINITE_CHECK_FILE
from cosyedge_build.quantize.texts import calibration_texts
from cosyedge_build.tools.device_fp16 import check_bundle, fp16_bundle
from cosyedge_models.bundle.loader import STATIC_FLOW_PREFIX, load_bundle
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer

from tests.support.components import require_cuda_provider
from tests.support.module_tmp import ModuleTmp

FP16_STAGES = ("llm_prefill", "llm_decode", "flow_estimator", "hift_decoder")


@pytest.fixture(scope="module")
def gpu_fp16(static_flow_bundle: Path, module_tmp: ModuleTmp) -> tuple[Path, dict[str, Any]]:
    out = fp16_bundle(static_flow_bundle, module_tmp.mktemp("fp16gpu") / "b")
    feeds = capture_feeds(static_flow_bundle, calibration_texts(4), cap_per_stage=12).feeds
    return out, feeds


def _static_feeds(bundle_dir: Path, name: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A fixed-shape call like a streaming one: half the cache valid, the window partly padded."""
    sess = ort.InferenceSession(str(bundle_dir / f"{name}.onnx"), providers=["CPUExecutionProvider"])
    shapes = {i.name: [int(d) for d in i.shape] for i in sess.get_inputs()}
    w, s = shapes["x"][2], shapes["att_cache"][0]
    mask = np.ones(shapes["mask"], np.float32)
    mask[:, :, w * 3 // 4:] = 0
    valid = np.zeros(s, np.float32)
    valid[: s // 2] = 1
    feeds = {k: (0.5 * rng.standard_normal(v)).astype(np.float32) for k, v in shapes.items()
             if k not in ("mask", "cache_valid", "commit_index", "t")}
    return {**feeds, "mask": mask, "cache_valid": valid, "t": np.array([0.3, 0.3], np.float32),
            "commit_index": np.array([w // 2, w // 2 + 1], np.int64)}


def _check_finite(out: Path, feeds: dict[str, Any], providers: list[str]) -> None:
    bundle = load_bundle(out, precision="fp16")
    for stage in FP16_STAGES:
        path = bundle.stages[stage].path
        assert path.name == f"{stage}.fp16.onnx"
        sess = ort.InferenceSession(str(path), providers=providers)
        names = {i.name for i in sess.get_inputs()}
        assert feeds[stage]
        for feed in feeds[stage]:
            for value in sess.run(None, {k: v for k, v in feed.items() if k in names}):
                assert np.isfinite(value).all(), stage
    rng = np.random.default_rng(0)
    statics = [n for n in bundle.stages if n.startswith(STATIC_FLOW_PREFIX)]
    assert statics
    for name in statics:
        assert bundle.stages[name].path.name == f"{name}.fp16.onnx"
        sess = ort.InferenceSession(str(bundle.stages[name].path), providers=providers)
        for value in sess.run(None, _static_feeds(out, name, rng)):
            assert np.isfinite(value).all(), name


def test_fp16_graphs_are_finite_on_the_calibration_set(gpu_fp16: tuple[Path, dict[str, Any]]) -> None:
    _check_finite(*gpu_fp16, ["CPUExecutionProvider"])


def test_the_tool_checks_the_bundle_and_writes_the_result(static_flow_bundle: Path,
                                                          gpu_fp16: tuple[Path, dict[str, Any]]) -> None:
    out, _ = gpu_fp16
    check = check_bundle(static_flow_bundle, out, texts=2, backend="ort")
    assert check["ok"] and check["providers"] == ["CPUExecutionProvider"]
    assert json.loads((out / FINITE_CHECK_FILE).read_text()) == check
    assert set(check["stages"]) == set(FP16_STAGES)
    for stage, s in check["stages"].items():
        assert s["inputs"] > 0 and s["nonfinite_inputs"] == 0, stage
        assert "LayerNormalization" not in s["fp32_ops"] and "Softmax" not in s["fp32_ops"], stage
    assert check["stages"]["llm_decode"]["fp32_ops"]["ReduceMean"] > 0


def test_fp16_bundle_speaks_with_the_fixed_shape_flow(gpu_fp16: tuple[Path, dict[str, Any]]) -> None:
    out, _ = gpu_fp16
    eng = load_synthesizer(out, settings=SynthesisSettings(backend="ort", graph_flow=True, overlap_stages=False))
    try:
        assert eng.bundle.precision == "fp16" and eng.flow.cache_dtype == np.float32
        pcm = np.concatenate([c.pcm for c in eng.synthesize(SynthesisRequest(text="Hello there.", seed=2))])
        assert eng.static_flow is not None and eng.static_flow.replays > 0
    finally:
        eng.close()
    assert pcm.size > 0 and np.isfinite(pcm).all() and np.abs(pcm).max() > 0


@pytest.mark.gpu
def test_fp16_graphs_are_finite_on_the_cuda_provider(gpu_fp16: tuple[Path, dict[str, Any]]) -> None:
    require_cuda_provider()
    _check_finite(*gpu_fp16, ["CUDAExecutionProvider"])


@pytest.mark.gpu
def test_the_tool_checks_on_the_cuda_provider(static_flow_bundle: Path, gpu_fp16: tuple[Path, dict[str, Any]]) -> None:
    require_cuda_provider()
    check = check_bundle(static_flow_bundle, gpu_fp16[0], texts=2)
    assert check["capture_backend"] == "ort-cuda" and check["ok"], check
    assert all(s["provider"] == "CUDAExecutionProvider" for s in check["stages"].values())


@pytest.mark.gpu
@pytest.mark.parametrize("faster_one", ["fp16", "fp32"])
def test_ort_cuda_loads_the_precision_recorded_faster(gpu_fp16: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                      faster_one: str) -> None:
    """models/bundle/precision_speed.py on the real CUDA backend: with precision unset, the
    variant the bundle's record measured faster (figures made up here: the rule, not the speed)."""
    require_cuda_provider()
    import shutil

    from cosyedge_models.bundle.precision_speed import write_record

    bundle = tmp_path / "b"
    shutil.copytree(gpu_fp16[0], bundle)
    slow, fast = {"rtf": 0.2, "first_audio_ms": 200.0}, {"rtf": 0.1, "first_audio_ms": 100.0}
    figures = {"fp16": fast, "fp32": slow} if faster_one == "fp16" else {"fp16": slow, "fp32": fast}
    write_record(bundle, "ort-cuda", figures)
    eng = load_synthesizer(bundle, settings=SynthesisSettings(backend="ort-cuda", graph_flow=False, graph_decode=False,
                                                              graph_vocoder=False))
    try:
        assert eng.bundle.precision == faster_one
        assert eng.bundle.stages["llm_decode"].path.name == ("llm_decode.fp16.onnx" if faster_one == "fp16"
                                                             else "llm_decode.onnx")
    finally:
        eng.close()
