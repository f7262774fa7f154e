"""The Jetson projection: roofline arithmetic, board peaks, and FLOPs counted from graphs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from cosyedge_models.tools.graph_cost import bundle_workload, graph_weights
from cosyedge_models.tools.projection import (
    BOARDS,
    DEVICES,
    PRECISIONS,
    StageCost,
    Workload,
    call_seconds,
    format_projection,
    project,
    projection_table,
)
from onnx import TensorProto, helper, numpy_helper


def test_peaks_follow_the_published_figures() -> None:
    agx = DEVICES["agx-orin-64gb"]
    assert agx.int8_tops == pytest.approx(85.0) and agx.fp16_tflops == pytest.approx(42.5)
    assert agx.fp32_tflops == pytest.approx(5.3, abs=0.05) and agx.bandwidth_gbs == 204.8
    # Orin Nano 8 GB at its original 625 MHz would give the data sheet's 20 dense INT8 TOPS
    nano = DEVICES["orin-nano-8gb"]
    assert nano.int8_tops * 0.625 / 1.02 == pytest.approx(20.4, abs=0.1)
    with pytest.raises(ValueError, match="allowed values"):
        agx.throughput("bf16")


def test_roofline_takes_the_slower_of_compute_and_memory() -> None:
    agx = DEVICES["agx-orin-64gb"]
    memory_bound = StageCost("decode", flops=1e9, weight_params=5e8, activation_elems=0)
    # 5e8 int8 weights at 204.8 GB/s
    assert call_seconds(memory_bound, agx, "int8") == pytest.approx(5e8 / 204.8e9)
    assert call_seconds(memory_bound, agx, "fp16") == pytest.approx(2 * 5e8 / 204.8e9)
    compute_bound = StageCost("flow", flops=8.5e12, weight_params=1e6, activation_elems=1e6)
    assert call_seconds(compute_bound, agx, "int8") == pytest.approx(0.1)


def test_project_sums_stages_into_first_audio_and_rtf() -> None:
    agx = DEVICES["agx-orin-64gb"]
    step = StageCost("llm_decode", 1e9, 5e8, 0)
    flow = StageCost("flow_estimator", 8.5e11, 1e6, 0)
    workload = Workload(first_audio={"llm_decode": [(step, 28.0)], "flow_estimator": [(flow, 10.0)]},
                        per_audio_second={"llm_decode": [(step, 25.0)], "flow_estimator": [(flow, 10.0)]})
    row = project(workload, agx, "int8")
    step_s, flow_s = 5e8 / 204.8e9, 8.5e11 / 85e12
    assert row["first_audio_ms"] == pytest.approx((28 * step_s + 10 * flow_s) * 1e3, rel=1e-3)
    assert row["rtf"] == pytest.approx(25 * step_s + 10 * flow_s, rel=1e-3)
    table = projection_table(workload, {"first_audio_ms": 633.0, "rtf": 0.116, "decode_step_ms": 3.4})
    assert len(table["boards"]) == len(BOARDS) * len(PRECISIONS)
    h200 = table["h200"]
    assert h200["measured_over_predicted"]["first_audio_ms"] == pytest.approx(
        633.0 / h200["predicted"]["first_audio_ms"], rel=0.01)
    assert "decode step" in format_projection(table)


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], outputs: list[str]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, "T"])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_graph_weights_follow_the_time_axis_through_strides() -> None:
    w1 = numpy_helper.from_array(np.zeros((16, 8, 3), np.float32), "w1")  # Conv 8 -> 16, stride 2
    w2 = numpy_helper.from_array(np.zeros((16, 4, 4), np.int8), "w2q")  # ConvTranspose 16 -> 4, stride 4, int8
    scale = numpy_helper.from_array(np.ones((16,), np.float32), "s")
    w3 = numpy_helper.from_array(np.zeros((4, 5), np.float32), "w3")  # MatMul on [.., T, 4]
    emb = numpy_helper.from_array(np.zeros((6, 7), np.float32), "spk")  # outside the time axis
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], strides=[2], pads=[1, 1]),
        helper.make_node("DequantizeLinear", ["w2q", "s"], ["w2"], axis=0),
        helper.make_node("ConvTranspose", ["a", "w2"], ["b"], strides=[4]),
        helper.make_node("Transpose", ["b"], ["bt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["bt", "w3"], ["c"]),
        helper.make_node("MatMul", ["spk", "spk"], ["unused"]),
        helper.make_node("Gemm", ["spk", "w3"], ["d"], transB=0),
    ]
    model = _model(nodes, [w1, w2, scale, w3, emb], ["c", "d"])
    w = graph_weights(model, {"x": 1.0})
    conv = 2 * 16 * 8 * 3 * 0.5  # per input frame: half as many output positions
    deconv = 2 * 16 * 4 * 4 * 0.5  # per input position of the deconvolution (rate 0.5)
    matmul = 2 * 4 * 5 * 2.0  # after x4 upsampling: rate 2
    assert w.per_unit_flops == pytest.approx(conv + deconv + matmul)
    # per use: w3 by the MatMul and the Gemm, spk as the second MatMul's weight
    assert w.params == 16 * 8 * 3 + 16 * 4 * 4 + 4 * 5 + 6 * 7 + 4 * 5
    assert w.fixed_flops == pytest.approx(2 * 4 * 5 + 2 * 6 * 7)


def test_bundle_workload_from_the_tiny_graphs(tiny_bundle: Path) -> None:
    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    workload = bundle_workload(tiny_bundle, manifest)
    assert set(workload.first_audio) == {"llm_prefill", "llm_decode", "flow_encoder", "flow_estimator", "vocoder"}
    (step, n), = workload.first_audio["llm_decode"]
    assert n == manifest["streaming"]["token_hop_len"] + manifest["flow"]["pre_lookahead_len"]
    # one token: at least 2 FLOPs per weight (every weight of a decode step is used once)
    assert step.flops >= 2 * step.weight_params > 0
    (prefill, _), = workload.first_audio["llm_prefill"]
    assert prefill.flops > 20 * step.flops  # 30 prompt tokens
    (est, steps), = workload.per_audio_second["flow_estimator"]
    assert steps == manifest["flow"]["n_timesteps"] and est.flops > 0
    row = project(workload, DEVICES["orin-nano-8gb"], "fp16")
    assert row["first_audio_ms"] > 0 and row["rtf"] > 0


def test_project_command_reports_the_launch_term(tiny_bundle: Path, tmp_path: Path) -> None:
    import argparse

    from cosyedge_models.tools.bench import project_command

    out = tmp_path / "p.json"
    assert project_command(argparse.Namespace(bundle=str(tiny_bundle), json=str(out), project_prompt_tokens=None)) == 0
    report = json.loads(out.read_text())
    launch = report["launch"]
    assert {(r["device"], r["concurrency"]) for r in launch["boards"]} == {(b, c) for b in BOARDS for c in (1, 4)}
    # the launch term comes on top of the roofline
    roof = report["h200"]["predicted"]["first_audio_ms"]
    assert launch["h200"]["predicted"]["first_audio_ms"][0] > roof
