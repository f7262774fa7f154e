"""fp16 by default on CUDA where it is faster (models/bundle/precision_speed.py): the
rule that picks a precision from the figures a bundle records, and where it applies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cosyedge_models.bundle.precision_speed import (
    PRECISION_SPEED_FILE,
    auto_precision,
    faster,
    has_precision,
    read_record,
    write_record,
)

BOTH: dict[str, Any] = {"precision": "fp16", "stages": {
    "llm_decode": {"file": "llm_decode.onnx", "precision": "fp32", "variants": {"fp16": {"file": "a.fp16.onnx"}}},
    "hift_source": {"file": "hift_source.onnx", "precision": "fp32",
                    "variants": {"fp16": {"file": "hift_source.onnx", "precision": "fp32"}}}}}
FP32_ONLY: dict[str, Any] = {"stages": {"llm_decode": {"file": "llm_decode.onnx"}}}


def _figures(rtf32: float, rtf16: float, first32: float | None = 100.0, first16: float | None = 90.0) -> dict[str, Any]:
    return {"fp32": {"rtf": rtf32, "first_audio_ms": first32}, "fp16": {"rtf": rtf16, "first_audio_ms": first16}}


def test_fp16_only_when_both_figures_say_so() -> None:
    assert faster(_figures(0.20, 0.15)) == "fp16"
    assert faster(_figures(0.20, 0.25)) == "fp32"  # slower offline
    assert faster(_figures(0.20, 0.15, 100.0, 120.0)) == "fp32"  # faster offline, later first audio
    assert faster(_figures(0.20, 0.15, None, None)) == "fp16"  # no first-audio figure: RTF decides
    assert faster(_figures(0.20, 0.20)) == "fp32"  # a tie keeps fp32
    assert faster({"fp32": {"rtf": 0.2}}) == "fp32" and faster({}) == "fp32"


def test_which_bundles_hold_both_precisions() -> None:
    assert has_precision(BOTH, "fp16") and has_precision(BOTH, "fp32")
    partial = {"stages": {**BOTH["stages"], "flow_estimator": {"file": "flow_estimator.onnx"}}}
    assert has_precision(partial, "fp32") and not has_precision(partial, "fp16")  # one stage lacks fp16
    assert has_precision(FP32_ONLY, "fp32") and not has_precision(FP32_ONLY, "fp16")
    assert has_precision({"precision": "fp16", "stages": {}}, "fp16")


def test_the_record_decides_on_cuda_only(tmp_path: Path) -> None:
    assert auto_precision(tmp_path, "ort-cuda", BOTH) is None  # no record: the bundle's own
    write_record(tmp_path, "ort-cuda", _figures(0.20, 0.15))
    assert json.loads((tmp_path / PRECISION_SPEED_FILE).read_text())["backends"]["ort-cuda"]["faster"] == "fp16"
    assert auto_precision(tmp_path, "ort-cuda", BOTH) == "fp16"
    assert auto_precision(tmp_path, "ort", BOTH) is None  # the CPU keeps the bundle's own
    assert auto_precision(tmp_path, "trt", BOTH) is None  # plans are built for one precision
    assert auto_precision(tmp_path, "ort-cuda", FP32_ONLY) is None  # fp16 not in the bundle
    write_record(tmp_path, "ort", _figures(0.2, 0.3))  # another backend's figures are kept beside
    record = read_record(tmp_path)
    assert set(record["backends"]) == {"ort-cuda", "ort"} and record["backends"]["ort"]["faster"] == "fp32"
    write_record(tmp_path, "ort-cuda", _figures(0.20, 0.25))  # measured again: now slower
    assert auto_precision(tmp_path, "ort-cuda", BOTH) == "fp32"


def test_an_unreadable_record_keeps_the_bundles_own(tmp_path: Path) -> None:
    (tmp_path / PRECISION_SPEED_FILE).write_text("{not json")
    assert read_record(tmp_path) == {} and auto_precision(tmp_path, "ort-cuda", BOTH) is None
