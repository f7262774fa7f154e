"""COSYEDGE_ORT_PROFILE: the ort backend's sessions write onnxruntime traces
and models/tools/ort_profile.py sums them per stage (what the H200 runs use to
see launch-bound stages and CPU fallbacks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer
from cosyedge_models.tools.ort_profile import PROFILE_ENV, main, summarize_dir, summarize_trace


def test_engine_sessions_write_traces_that_sum_per_stage(tiny_bundle: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "prof"
    monkeypatch.setenv(PROFILE_ENV, str(prof))
    engine = load_synthesizer(tiny_bundle, settings=SynthesisSettings(threads=1, overlap_stages=False))
    try:
        chunks = list(engine.synthesize(SynthesisRequest(text="Profile me, please.", stream=False, seed=3)))
        tokens = chunks[-1].times.llm_tokens
    finally:
        engine.close()  # the traces are written here
    stages = {p.stage: p for p in summarize_dir(prof)}
    assert {"llm_prefill", "llm_decode", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder"} <= set(stages)
    # prefill samples the first speech token, each decode run the next one or the end token
    assert stages["llm_decode"].runs == tokens
    assert stages["llm_prefill"].runs == 1
    est = stages["flow_estimator"]
    assert est.runs >= 2 and est.ms_per_run > 0 and est.kernel_ms > 0
    assert set(est.provider_ms) == {"CPUExecutionProvider"}
    assert est.cpu_nodes == []  # only a GPU session lists its CPU fallbacks
    assert est.top_ops and est.top_ops[0].ms >= est.top_ops[-1].ms
    assert main([str(prof), "--json", str(tmp_path / "s.json")]) == 0
    assert "flow_estimator:" in capsys.readouterr().out
    assert {r["stage"] for r in json.loads((tmp_path / "s.json").read_text())} == set(stages)


def test_gpu_session_lists_cpu_fallbacks_and_copies() -> None:
    node = {"cat": "Node", "dur": 1000}
    events = [
        {"cat": "Session", "name": "model_run", "dur": 5000},
        {**node, "name": "MatMul_1_kernel_time", "args": {"op_name": "MatMul", "provider": "CUDAExecutionProvider"}},
        {**node, "name": "Shape_3_kernel_time", "args": {"op_name": "Shape", "provider": "CPUExecutionProvider"}},
        {**node, "name": "Memcpy_kernel_time", "args": {"op_name": "MemcpyToHost",
                                                         "provider": "CUDAExecutionProvider"}},
        {"cat": "Node", "name": "MatMul_1_fence_before", "dur": 7},  # not a kernel
    ]
    p = summarize_trace("x", events)
    assert p.runs == 1 and p.ms_per_run == 5.0
    assert p.cpu_nodes == ["Shape_3"]
    assert p.copies_per_run == 1.0 and p.kernels_per_run == 3.0
    assert p.provider_ms == {"CUDAExecutionProvider": 2.0, "CPUExecutionProvider": 1.0}


def test_missing_or_empty_directory_is_an_error(tmp_path: Path) -> None:
    assert main([str(tmp_path / "nope")]) == 2
    assert main([str(tmp_path)]) == 1
