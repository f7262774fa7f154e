"""Tiny ONNX graphs for the emulator's own tests (and anyone who needs an engine in a test)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

WEIGHT = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0
BIAS = np.array([0.5, -1.0, 2.0], np.float32)


def affine_model(path: Path, dynamic: bool = True) -> Path:
    """y = relu(x @ WEIGHT + BIAS) for x [B, T, 4] (B and T dynamic, or fixed at [1, 8, 4])."""
    b, t = ("B", "T") if dynamic else (1, 8)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, t, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, t, 3])
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"], name="matmul"),
        helper.make_node("Add", ["xw", "bias"], ["pre"], name="add"),
        helper.make_node("Relu", ["pre"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(nodes, "affine", [x], [y],
                              [numpy_helper.from_array(WEIGHT, "w"), numpy_helper.from_array(BIAS, "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def affine_reference(x: np.ndarray) -> np.ndarray:
    """What the affine model computes, in numpy (the independent expectation)."""
    return np.maximum(x.astype(np.float32) @ WEIGHT + BIAS, 0.0)


def build_plan(trt: object, onnx_path: Path, profiles: list[dict[str, tuple[tuple[int, ...], ...]]] | None = None,
               strongly_typed: bool = False, flags: tuple[str, ...] = ()) -> bytes | None:
    """Build an engine with the (emulated) tensorrt module the way a TensorRT user does; None when the
    build fails (as build_serialized_network reports it)."""
    t = trt  # typed loosely: the emulated module
    logger = t.Logger(t.Logger.WARNING)  # type: ignore[attr-defined]
    builder = t.Builder(logger)  # type: ignore[attr-defined]
    net_flags = 1 << int(t.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0  # type: ignore[attr-defined]
    network = builder.create_network(net_flags)
    parser = t.OnnxParser(network, logger)  # type: ignore[attr-defined]
    if not parser.parse_from_file(str(onnx_path)):
        raise ValueError("; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
    config = builder.create_builder_config()
    for flag in flags:
        config.set_flag(getattr(t.BuilderFlag, flag))  # type: ignore[attr-defined]
    for prof in profiles or []:
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in prof.items():
            p.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(p)
    plan = builder.build_serialized_network(network, config)
    return None if plan is None else bytes(plan)


def precision_model(path: Path, kind: str) -> Path:
    """The affine model carrying its precision in the graph, as strongly typed builds want it:
    kind "fp16": fp16 weights, Casts at the fp32 inputs/outputs; "qdq": Q/DQ pairs (int8) on the
    activation and the weight, the bias and Relu in fp32."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", 3])
    inits = [numpy_helper.from_array(BIAS, "bias")]
    if kind == "fp16":
        inits.append(numpy_helper.from_array(WEIGHT.astype(np.float16), "w16"))
        nodes = [helper.make_node("Cast", ["x"], ["x16"], name="cast_in", to=TensorProto.FLOAT16),
                 helper.make_node("MatMul", ["x16", "w16"], ["xw16"], name="matmul"),
                 helper.make_node("Cast", ["xw16"], ["xw"], name="cast_out", to=TensorProto.FLOAT)]
    elif kind == "qdq":
        scale_x, scale_w = np.float32(0.05), np.float32(0.01)
        inits += [numpy_helper.from_array(WEIGHT, "w"), numpy_helper.from_array(np.array(scale_x), "sx"),
                  numpy_helper.from_array(np.array(scale_w), "sw"), numpy_helper.from_array(np.array(0, np.int8), "z")]
        nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "z"], ["xq"], name="q_x"),
                 helper.make_node("DequantizeLinear", ["xq", "sx", "z"], ["xd"], name="dq_x"),
                 helper.make_node("QuantizeLinear", ["w", "sw", "z"], ["wq"], name="q_w"),
                 helper.make_node("DequantizeLinear", ["wq", "sw", "z"], ["wd"], name="dq_w"),
                 helper.make_node("MatMul", ["xd", "wd"], ["xw"], name="matmul")]
    else:
        raise ValueError(kind)
    nodes += [helper.make_node("Add", ["xw", "bias"], ["pre"], name="add"),
              helper.make_node("Relu", ["pre"], ["y"], name="relu")]
    model = helper.make_model(helper.make_graph(nodes, kind, [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
