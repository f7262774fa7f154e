"""The fp16 build's overflow check (edge_build/quantize/finite.py) names the stage and
the output that went non-finite, and the quantize pipeline refuses on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from cosyedge_build.quantize.finite import failures, finite_check
from cosyedge_build.quantize.fp16 import convert_fp16
from onnx import TensorProto, helper


def _graph(tmp_path: Path) -> Path:
    """y = x * 1000 (fp16 overflows past x = 65.5), z = x + 1; y given in fp16, so that the
    CPU, which runs fp16 islands in fp32, overflows too (in the output's Cast)."""
    nodes = [helper.make_node("Mul", ["x", "k"], ["y"], name="scale"), helper.make_node("Add", ["x", "one"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("y", "z")],
                              [helper.make_tensor("k", TensorProto.FLOAT, [], [1000.0]),
                               helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    src, dst = tmp_path / "g.onnx", tmp_path / "g.fp16.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    convert_fp16(src, dst, fp16_io=("y",))
    return dst


def test_overflow_is_found_and_named(tmp_path: Path) -> None:
    path = _graph(tmp_path)
    small, large = np.full(4, 1.0, np.float32), np.array([1.0, 2.0, 70.0, 3.0], np.float32)
    check = finite_check({"stage": path}, {"stage": [{"x": small}, {"x": large}, {"x": small}]})
    s = check["stages"]["stage"]
    assert not check["ok"] and (s["inputs"], s["nonfinite_inputs"], s["nonfinite_outputs"]) == (3, 1, ["y"])
    assert failures(check) == ["stage: NaN/Inf on 1 of 3 calibration inputs (outputs y)"]
    assert s["fp16_ops"] == {"Add": 1, "Mul": 1} and s["fp32_ops"] == {}
    fine = finite_check({"stage": path}, {"stage": [{"x": small}]})
    assert fine["ok"] and failures(fine) == []


def test_a_stage_without_feeds_fails(tmp_path: Path) -> None:
    check = finite_check({"stage": _graph(tmp_path)}, {})
    assert not check["ok"] and failures(check) == ["stage: no calibration inputs reached it"]
