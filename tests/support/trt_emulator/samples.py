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
