"""device_fp16.py's fused decode stages: an fp32 fused step and insert graph in
the source bundle get fp16 variants (the fp16 cache I/O in the graph and in the
variant entry, `kv_cache.dtype` float16) that FusedDecodeStep runs over an fp16
buffer, within fp16's error of the fp32 source graphs; fp16 sources get none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from cosyedge_build.export.llm_fused import export_fused_decode
from cosyedge_build.reference.modules import load_reference
from cosyedge_build.tools.device_fp16 import fused_fp16_variants
from cosyedge_models.backends.ort import OrtSession
from cosyedge_models.batching.fused_step import FusedDecodeStep

POSITIONS = 24
FP16_LOGP_TOLERANCE = 0.03  # as tests/models/batching/test_fused_step.py


def _entry(stage: Any) -> dict[str, Any]:  # the manifest entry's fields (edge_build/export/bundle.py)
    return {"file": stage.file, "precision": "fp32", "inputs": [t.as_dict() for t in stage.inputs],
            "outputs": [t.as_dict() for t in stage.outputs], **stage.extra}


def _step(folder: Path, files: dict[str, str], bundle: Path) -> FusedDecodeStep:
    def session(name: str, path: Path) -> OrtSession:
        return OrtSession(name, path, ["CPUExecutionProvider"], 0, 1)

    return FusedDecodeStep({1: session("b1", folder / files["llm_decode_fused_b1"])},
                           session("insert", folder / files["llm_fused_kv_insert"]),
                           session("llm_prefill", bundle / "llm_prefill.onnx"), ("cpu", 0))


def test_fp32_fused_stages_get_fp16_variants(tiny_model_dir: Path, tiny_bundle: Path, tmp_path: Path) -> None:
    llm = load_reference(tiny_model_dir).llm
    src, dst, already = tmp_path / "src", tmp_path / "dst", tmp_path / "fp16src"
    for d in (src, dst, already):
        d.mkdir()
    stages = export_fused_decode(llm, src, [1], POSITIONS)
    variants = fused_fp16_variants(src, dst, {"stages": {s.name: _entry(s) for s in stages}})
    assert sorted(variants) == ["llm_decode_fused_b1", "llm_fused_kv_insert"]
    for name, variant in variants.items():
        assert variant["precision"] == "fp16" and variant["kv_cache"]["dtype"] == "float16"
        session = ort.InferenceSession(str(dst / variant["file"]), providers=["CPUExecutionProvider"])
        declared = {v.name: v.type for v in (*session.get_inputs(), *session.get_outputs())}
        for spec in (*variant["inputs"], *variant["outputs"]):
            want = {"float16": "tensor(float16)", "float32": "tensor(float)", "int32": "tensor(int32)",
                    "int64": "tensor(int64)"}[spec["dtype"]]
            assert declared[spec["name"]] == want, (name, spec)
    assert {s["name"]: s["dtype"] for s in variants["llm_decode_fused_b1"]["inputs"]}["inputs_embeds"] == "float32"

    fp32 = _step(src, {s.name: s.file for s in stages}, tiny_bundle)
    fp16 = _step(dst, {n: v["file"] for n, v in variants.items()}, tiny_bundle)
    assert fp32.kv_dtype == np.float32 and fp16.kv_dtype == np.float16
    speech = np.load(tiny_bundle / "llm_speech_embedding.npy")
    x = (np.random.default_rng(2).standard_normal((1, 6, speech.shape[1])) * 0.05).astype(np.float32)
    for step in (fp32, fp16):
        step.prefill(0, x)
    tokens = [3, 17, 5]
    for k, token in enumerate(tokens):
        ref = fp32.step([0], speech[[token]], [6 + k], 1)
        got = fp16.step([0], speech[[token]], [6 + k], 1)
        assert float(np.abs(got - ref).max()) < FP16_LOGP_TOLERANCE

    # a source whose fused graphs are fp16 already: nothing to convert
    stages16 = export_fused_decode(llm, already, [1], POSITIONS, "fp16")
    assert fused_fp16_variants(already, dst, {"stages": {s.name: _entry(s) for s in stages16}}) == {}

