"""The fp16 conversion's node names: onnxruntime 1.31's converter gave two Casts
one name (one per blocked consumer of a tensor), which onnxruntime refuses to
load; `unique_node_names` renames repeats so the graph loads and computes the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cosyedge_build.quantize.fp16 import unique_node_names
from onnx import TensorProto, helper


def _model_with_repeated_names() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Cast", ["x"], ["a"], name="/Concat_output_0_cast_to_fp32_node", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["x"], ["b"], name="/Concat_output_0_cast_to_fp32_node", to=TensorProto.FLOAT),
        helper.make_node("Add", ["a", "b"], ["c"], name="add"),
        helper.make_node("Relu", ["c"], ["y"], name="add_2"),  # a name a naive suffix would collide with
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_repeated_names_are_refused_then_renamed_and_the_graph_loads() -> None:
    model = _model_with_repeated_names()
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        refused = False
    except Exception as exc:  # noqa: BLE001 - onnxruntime's load error type is not public
        refused = "same node name" in str(exc)
    assert refused
    assert unique_node_names(model.graph) == 1
    names = [n.name for n in model.graph.node]
    assert len(set(names)) == len(names) and names[0] == "/Concat_output_0_cast_to_fp32_node"
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([-1.0, 2.0], dtype=np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(2 * x, 0))
    assert unique_node_names(model.graph) == 0


def test_repeated_casts_of_onnxruntime_131_are_merged() -> None:
    """What onnxruntime 1.31's converter writes for two blocked consumers of one float16
    tensor: two identical Casts defining one tensor (refused: "Duplicate definition")."""
    from cosyedge_build.quantize.fp16 import drop_repeated_casts

    cast = helper.make_node("Cast", ["h"], ["h_cast_to_fp32"], name="h_cast_to_fp32_node", to=TensorProto.FLOAT)
    nodes = [
        helper.make_node("Cast", ["x"], ["h"], name="to16", to=TensorProto.FLOAT16),
        cast, helper.make_node("Softmax", ["h_cast_to_fp32"], ["a"], name="sm", axis=-1),
        onnx.NodeProto(), helper.make_node("LayerNormalization", ["h_cast_to_fp32", "s", "b"], ["c"], name="ln"),
        helper.make_node("Add", ["a", "c"], ["y"], name="add"),
    ]
    nodes[3].CopyFrom(cast)
    vi = helper.make_tensor_value_info("h_cast_to_fp32", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor("s", TensorProto.FLOAT, [4], [1.0] * 4),
                               helper.make_tensor("b", TensorProto.FLOAT, [4], [0.0] * 4)], value_info=[vi, vi])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        refused = False
    except Exception as exc:  # noqa: BLE001 - onnxruntime's load error type is not public
        refused = "same node name" in str(exc) or "Duplicate definition" in str(exc)
    assert refused
    assert drop_repeated_casts(model.graph) == 1 and len(model.graph.value_info) == 1
    assert unique_node_names(model.graph) == 0
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([[0.5, -1.0, 2.0, 0.0]], dtype=np.float32)
    h = x.astype(np.float16).astype(np.float32)
    soft = np.exp(h - h.max()) / np.exp(h - h.max()).sum()
    norm = (h - h.mean()) / np.sqrt(h.var() + 1e-5)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], soft + norm, atol=1e-5)


def test_a_shared_weights_file_with_several_hard_links_converts(tiny_bundle: Path, tmp_path: Path) -> None:
    """Every bundle `build quantize` writes hard-links the source's llm_weights.bin, and onnx
    refuses to read external data with several links (the full-size fp16 run failed on it)."""
    import os
    import shutil

    from cosyedge_build.quantize.fp16 import convert_fp16

    src = tmp_path / "src"
    src.mkdir()
    for name in ("llm_prefill.onnx", "llm_weights.bin"):
        shutil.copyfile(tiny_bundle / name, src / name)
    os.link(src / "llm_weights.bin", tmp_path / "another-bundle-llm_weights.bin")
    with pytest.raises(onnx.checker.ValidationError, match="hard link"):
        onnx.load(str(src / "llm_prefill.onnx"))
    out = tmp_path / "out"
    out.mkdir()
    convert_fp16(src / "llm_prefill.onnx", out / "llm_prefill.fp16.onnx")
    sess = ort.InferenceSession(str(out / "llm_prefill.fp16.onnx"), providers=["CPUExecutionProvider"])
    d = next(i.shape[2] for i in sess.get_inputs() if i.name == "inputs_embeds")
    x = (np.random.default_rng(0).standard_normal((1, 4, d)) * 0.1).astype(np.float32)
    logp = sess.run(["logp"], {"inputs_embeds": x, "attention_mask": np.ones((1, 4), np.int64)})[0]
    assert np.isfinite(logp).all()
    assert not list(out.glob(".fp16-*"))  # the copy is gone


def test_topological_sort_puts_producers_first() -> None:
    """The float16 converter appends its input casts after their readers (TensorRT's parser and the
    ONNX checker refuse that order); the sort moves them before, keeping the rest in place."""
    from cosyedge_build.quantize.fp16 import topological_sort

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Relu", ["xh"], ["a"], name="relu"),
             helper.make_node("Neg", ["a"], ["b"], name="neg"),
             helper.make_node("Cast", ["b"], ["y"], to=TensorProto.FLOAT, name="out_cast"),
             helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16, name="in_cast")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]))
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(model)
    assert topological_sort(model.graph)
    assert [n.name for n in model.graph.node] == ["in_cast", "relu", "neg", "out_cast"]
    onnx.checker.check_model(model)
    assert not topological_sort(model.graph)  # already in order: unchanged
