"""The fp16 policy (edge_build/quantize/fp16.py): only the ops whose values overflow
or lose their meaning in fp16 stay fp32 (Sin/Cos/Exp/Softplus/Pow, reductions, index
arithmetic), with their elementwise tails and arguments; LayerNormalization and Softmax
run in fp16. onnxruntime's CPU provider runs fp16 nodes it has no fp16 kernel for in
fp32, so on the CPU the graph structure is checked (which ops stay fp32, how many Casts)
and the numbers where the Casts themselves decide them (a value rounded or overflowed in
fp16 before an fp32 op); the CUDA provider runs them in `-m gpu` (test_fp16_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cosyedge_build.quantize.companions import always_fp32_nodes, unit_of
from cosyedge_build.quantize.fp16 import FP16_KEEP_FP32_OPS, convert_fp16, precision_summary
from onnx import TensorProto, helper

STAGES = ("llm_decode", "flow_estimator", "hift_decoder")


def _convert(src: Path, dst: Path, keep: tuple[str, ...] = FP16_KEEP_FP32_OPS) -> dict[str, object]:
    stage = src.name.removesuffix(".onnx")
    convert_fp16(src, dst, always_fp32_nodes(unit_of(stage), src), keep_fp32_ops=keep)
    return precision_summary(onnx.load(str(dst), load_external_data=False))


@pytest.mark.parametrize("stage", STAGES)
def test_only_overflowing_ops_stay_fp32(stage: str, tiny_bundle: Path, tmp_path: Path) -> None:
    src = tiny_bundle / f"{stage}.onnx"
    source_ops = {n.op_type for n in onnx.load(str(src), load_external_data=False).graph.node}
    summary = _convert(src, tmp_path / f"{stage}.fp16.onnx")
    fp32, fp16 = summary["fp32_ops"], summary["fp16_ops"]
    assert isinstance(fp32, dict) and isinstance(fp16, dict)
    for op in ("LayerNormalization", "Softmax", "MatMul", "Conv"):
        assert op not in fp32 or op == "Conv" and stage == "hift_decoder"  # the vocoder's STFT conv stays fp32
        if op in source_ops:
            assert fp16.get(op, 0) > 0, op
    for op in set(FP16_KEEP_FP32_OPS) & source_ops - {"Range", "CumSum"}:  # index ops read no float here
        assert fp32.get(op, 0) > 0 and op not in fp16, op


def test_cast_round_trips_are_folded(tiny_bundle: Path, tmp_path: Path) -> None:
    """The converter casts each blocked node's result to fp16 and back for the next blocked
    node (RMSNorm: Pow -> ReduceMean -> Add -> Sqrt); no such pair is left."""
    dst = tmp_path / "llm_decode.fp16.onnx"
    _convert(tiny_bundle / "llm_decode.onnx", dst)
    graph = onnx.load(str(dst), load_external_data=False).graph
    producer = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        first = producer.get(node.input[0]) if node.op_type == "Cast" else None
        if first is not None and first.op_type == "Cast":
            assert (first.attribute[0].i, node.attribute[0].i) != (TensorProto.FLOAT16, TensorProto.FLOAT), node.name


def test_fewer_casts_than_with_layernorm_and_softmax_kept_fp32(tiny_bundle: Path, tmp_path: Path) -> None:
    """The earlier policy also kept LayerNormalization and Softmax (and Erf, Sqrt, Reciprocal)
    in fp32: a Cast in and out of each (599 in the full-size estimator)."""
    src = tiny_bundle / "flow_estimator.onnx"
    old = FP16_KEEP_FP32_OPS + ("LayerNormalization", "Softmax", "Erf", "Sqrt", "Reciprocal")
    new, before = _convert(src, tmp_path / "new.onnx"), _convert(src, tmp_path / "old.onnx", old)
    layer_norms = sum(n.op_type in ("LayerNormalization", "Softmax") for n in onnx.load(str(src)).graph.node)
    assert layer_norms > 0
    assert isinstance(new["casts"], int) and isinstance(before["casts"], int)
    assert new["casts"] + layer_norms <= before["casts"]


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
           inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, tmp_path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    src, dst = tmp_path / "m.onnx", tmp_path / "m.fp16.onnx"
    onnx.save(model, str(src))
    convert_fp16(src, dst)
    sess = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, feeds)[0])


def test_rms_norm_of_large_activations_stays_finite(tmp_path: Path) -> None:
    """x^2's mean over hidden states of a few hundred passes fp16's 65504: with only Pow and
    ReduceMean kept fp32, the cast before `+ eps` gave inf and 1/sqrt(inf) zeroed the row."""
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"], name="pow"),
             helper.make_node("ReduceMean", ["sq"], ["ms"], name="mean", axes=[-1]),
             helper.make_node("Add", ["ms", "eps"], ["mse"], name="add_eps"),
             helper.make_node("Sqrt", ["mse"], ["rms"], name="sqrt"),
             helper.make_node("Div", ["one", "rms"], ["inv"], name="inv"),
             helper.make_node("Mul", ["x", "inv"], ["y"], name="scale")]
    consts = (("two", 2.0), ("eps", 1e-6), ("one", 1.0))
    inits = [helper.make_tensor(name, TensorProto.FLOAT, [], [v]) for name, v in consts]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])], inits)
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32) * 400  # rms ~ 400
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    got = _run(model, tmp_path, {"x": x})
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("as_constant_node", [False, True])
def test_rotary_phase_of_late_positions_is_computed_in_fp32(tmp_path: Path, as_constant_node: bool) -> None:
    """position * frequency feeds Sin: fp16 rounds position 3001 to 3000 (steps of 2 past
    2048) and a frequency to 11 bits (0.1779 by 9e-5: 0.35 rad at position 4095); the
    phase's arguments, the frequencies (an initializer, or a Constant node as the LLM
    export writes them) included, stay fp32 with Sin."""
    freq = np.array([1.0, 0.17782794, 0.03162278, 0.00562341], np.float32)
    nodes = [helper.make_node("Cast", ["pos"], ["posf"], name="to_float", to=TensorProto.FLOAT),
             helper.make_node("Mul", ["posf", "freq"], ["phase"], name="phase"),
             helper.make_node("Sin", ["phase"], ["s"], name="sin"),
             helper.make_node("Mul", ["s", "h"], ["y"], name="rotate")]
    tensor = helper.make_tensor("freq", TensorProto.FLOAT, [4], freq.tolist())
    if as_constant_node:
        nodes.insert(0, helper.make_node("Constant", [], ["freq"], name="freq_const", value=tensor))
    model = _model(nodes, [helper.make_tensor_value_info("pos", TensorProto.INT64, [5, 1]),
                           helper.make_tensor_value_info("h", TensorProto.FLOAT, [5, 4])],
                   [] if as_constant_node else [tensor])
    pos = np.array([[1], [700], [2049], [3001], [4095]], np.int64)
    h = np.ones((5, 4), np.float32)
    got = _run(model, tmp_path, {"pos": pos, "h": h})
    np.testing.assert_allclose(got, np.sin(pos.astype(np.float64) * freq), atol=2e-3)
