"""Flow batching on ort-cuda gives up the fixed-shape CUDA graphs; the engine says so when it loads
(measured far slower on an H200, docs/gpu.md). A CPU-only onnxruntime runs an ort-cuda engine on the
CPU, so the load path is the one a GPU takes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer

WARNING = "flow batching on ort-cuda"


@pytest.mark.parametrize(("backend", "warned"), [("ort-cuda", True), ("ort", False)])
def test_flow_batching_warns_only_on_ort_cuda(tiny_bundle: Path, caplog: pytest.LogCaptureFixture,
                                              backend: str, warned: bool) -> None:
    caplog.set_level(logging.WARNING, logger="cosyedge_models.synthesis.graph_stages")
    engine = load_synthesizer(tiny_bundle, settings=SynthesisSettings(
        backend=backend, flow_batching=BatchSettings(max_batch_size=2)))
    try:
        assert any(WARNING in r.getMessage() for r in caplog.records) is warned
        assert engine.stage_batchers  # flow batching itself is on either way
    finally:
        engine.close()


def test_no_warning_without_flow_batching(tiny_bundle: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cosyedge_models.synthesis.graph_stages")
    engine = load_synthesizer(tiny_bundle, settings=SynthesisSettings(backend="ort-cuda"))
    try:
        assert not any(WARNING in r.getMessage() for r in caplog.records)
    finally:
        engine.close()
