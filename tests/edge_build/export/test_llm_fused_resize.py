"""The fused graphs of the larger batch sizes and prompt lengths are the smallest ones resized
(edge_build/export/llm_fused.py, _resize): the bytes must be those of a graph built (and
converted) for that size alone."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from cosyedge_build.export.llm_fused import (
    build_fused_decode,
    build_fused_prefill,
    convert_fused_fp16_in_place,
    export_fused_decode,
)
from cosyedge_build.reference.modules import load_reference

POSITIONS = 40


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resized_graphs_are_the_graphs_built_for_their_size(tiny_model_dir: Path, tmp_path: Path,
                                                            precision: str) -> None:
    llm = load_reference(tiny_model_dir).llm
    out = tmp_path / "export"
    out.mkdir()
    stages = export_fused_decode(llm, out, [4, 1, 2, 8], POSITIONS, precision, prefill_lengths=[8, 4, 12])
    names = [s.name for s in stages]
    assert names == ["llm_decode_fused_b1", "llm_decode_fused_b2", "llm_decode_fused_b4", "llm_decode_fused_b8",
                     "llm_prefill_fused_t4", "llm_prefill_fused_t8", "llm_prefill_fused_t12", "llm_fused_kv_insert"]
    assert sorted(p.name for p in out.iterdir()) == sorted(s.file for s in stages)  # nothing left beside them
    alone = tmp_path / "alone"
    alone.mkdir()
    for build, size in ((build_fused_decode, 2), (build_fused_decode, 8), (build_fused_prefill, 12)):
        model, stage = build(llm, size, POSITIONS)
        path = alone / stage.file
        onnx.save_model(model, str(path))
        if precision == "fp16":
            convert_fused_fp16_in_place(path)
        resized = onnx.load(str(out / stage.file))
        assert resized.SerializeToString() == onnx.load(str(path)).SerializeToString(), stage.name
        spec = next(s for s in stages if s.name == stage.name)
        assert [t.shape for t in spec.inputs] == [t.shape for t in stage.inputs]
        assert [t.shape for t in spec.outputs] == [t.shape for t in stage.outputs]


def test_the_export_timing_tool_finds_both_ways_equal(tiny_model_dir: Path, tmp_path: Path) -> None:
    """edge_build/tools/fused_export_time.py (the figure in docs/gpu.md): both ways timed, the same bytes."""
    import json

    from cosyedge_build.tools.fused_export_time import main

    out = tmp_path / "t.json"
    assert main(["--model-dir", str(tiny_model_dir), "--out", str(out), "--batches", "1,2",
                 "--prefill-lengths", "4,8", "--positions", str(POSITIONS)]) == 0
    result = json.loads(out.read_text())
    assert set(result["same_bytes"]) == {"llm_decode_fused_b1.onnx", "llm_decode_fused_b2.onnx",
                                         "llm_prefill_fused_t4.onnx", "llm_prefill_fused_t8.onnx",
                                         "llm_fused_kv_insert.onnx"}
    assert all(result["same_bytes"].values())
    assert set(result["one_by_one_per_graph_s"]) == {n.removesuffix(".onnx") for n in result["same_bytes"]}
