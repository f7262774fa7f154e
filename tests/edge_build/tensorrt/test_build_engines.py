"""`cosyedge build engines` on the tiny bundle at fp32, fp16 and INT8 (Q/DQ), under the TensorRT
emulator (tests/support/trt_emulator) for TensorRT 10.3 (JetPack 6.2), 10.13 (JetPack 7.0) and 11:
the plans it writes carry the stage's tensors and the manifest's profiles, are strongly typed with
no precision flag (TensorRT 11 has no weak typing), deserialize, and run as the ONNX graph does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cosyedge_build.tensorrt.engines import EngineBuildSettings, build_engines
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.profiles import all_input_ranges
from cosyedge_models.bundle.loader import STAGES, load_bundle

from tests.support.trt_emulator import VERSIONS, Emulation
from tests.support.trt_emulator import plan as planfmt

VERSION_PARAMS = [pytest.param(v, id=f"trt{v}") for v in ("10.3", "10.13", "11")]


def _build(bundle: Path, tmp_path: Path, precision: str) -> tuple[Path, dict[str, Any], list[str]]:
    root = tmp_path / "bundle"
    shutil.copytree(bundle, root)
    lines: list[str] = []
    engines = build_engines(root, EngineBuildSettings(precision=precision, workspace_mib=64), progress=lines.append)
    return root, engines, lines


def _inputs(onnx_path: Path, profile: dict[str, Any]) -> dict[str, np.ndarray]:
    """Inputs at the profile's min shapes: floats random, integers ones (lengths, masks, ids)."""
    rng = np.random.default_rng(0)
    model = onnx.load(str(onnx_path), load_external_data=False)
    types = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in model.graph.input}
    out = {}
    for name, r in profile.items():
        dtype = np.dtype(types[name])
        out[name] = (rng.standard_normal(r.min).astype(dtype) if dtype.kind == "f"
                     else np.ones(r.min, dtype))
    return out


@pytest.mark.parametrize("emulated_tensorrt", VERSION_PARAMS, indirect=True)
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_build_engines_at_each_precision(emulated_tensorrt: Emulation, precision_bundles: dict[str, Path],
                                         precision: str, tmp_path: Path) -> None:
    root, engines, lines = _build(precision_bundles[precision], tmp_path, precision)
    version = emulated_tensorrt.env.full_version
    assert engines["tensorrt"] == VERSIONS[emulated_tensorrt.env.version] == version
    assert engines["precision"] == precision and engines["gpu"] == emulated_tensorrt.env.gpu.name
    assert json.loads((root / "manifest.json").read_text())["engines"] == engines
    assert not emulated_tensorrt.errors_logged(), emulated_tensorrt.errors_logged()
    # no deprecated weak-typing call or flag (TensorRT 10.12+ warns about them; 11 refuses them)
    assert not [m for _, m in emulated_tensorrt.journal if "deprecated" in m or "weak" in m.lower()]
    bundle = load_bundle(root, precision)
    carried = set()
    for stage, rec in engines["stages"].items():
        if "engine_of" in rec:
            assert stage == "llm_prefill" and rec["file"] == engines["stages"]["llm_decode"]["file"]
            continue
        info = bundle.stages[stage]
        parsed = planfmt.parse((root / rec["file"]).read_bytes())
        assert parsed is not None, stage
        header, graph = parsed
        assert header.tensorrt == version and header.strongly_typed and header.flags == [], (stage, header.flags)
        assert header.fp32_layers == []  # nothing pinned: the graph's types are the policy
        model = onnx.load(str(info.path), load_external_data=False)
        inits = {t.name for t in model.graph.initializer}
        assert [t.name for t in header.io if t.is_input] == [i.name for i in model.graph.input if i.name not in inits]
        assert [t.name for t in header.io if not t.is_input] == [o.name for o in model.graph.output]
        assert header.profiles == rec["profiles"], stage  # what the manifest records is what was built
        expected = [{n: [list(r.min), list(r.opt), list(r.max)] for n, r in p.items()}
                    for p in all_input_ranges(info.raw, stage)]
        assert rec["profiles"] == expected, stage
        assert rec["strongly_typed"] and rec["precision"] == info.precision
        carried.add(rec["precision_from"])
        assert rec["device_memory_bytes"] == header.activation_bytes
        assert onnx.load_from_string(graph).graph.node == model.graph.node  # the stage's own graph
    want = {"fp32": {"fp32"}, "fp16": {"fp16 casts"}, "int8": {"Q/DQ"}}[precision]
    assert want <= carried, carried
    assert any("strongly typed" in line for line in lines)

    # the plans deserialize and run (the trt backend's session) as the ONNX graph runs on onnxruntime
    backend = create_backend("trt")
    for stage in STAGES:
        rec = engines["stages"][stage]
        if "engine_of" in rec:
            continue
        info = bundle.stages[stage]
        onnx_path = root / rec["onnx"]
        feeds = _inputs(onnx_path, all_input_ranges(info.raw, stage)[0])
        session = backend.load(stage, root / rec["file"])
        try:
            got = session.run(feeds)
        finally:
            session.close()
        want_out = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, feeds)
        names = [o.name for o in ort.InferenceSession(str(onnx_path)).get_outputs()]
        for name, value in zip(names, want_out, strict=True):
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=f"{stage}.{name}")
