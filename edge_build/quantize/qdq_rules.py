"""TensorRT's explicit-quantization rules that can be checked on the ONNX
graph: every quantized MatMul/Gemm/Conv reads DequantizeLinear on its data
and weight inputs; weights are int8 constants behind a DequantizeLinear (no
QuantizeLinear on them); activations are QuantizeLinear -> DequantizeLinear
pairs with a per-tensor scale; zero points are 0 and int8; scales positive
and finite; per-channel weight scales lie on the output-channel axis and
have one entry per output channel."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

QUANTIZED_OPS = ("MatMul", "Gemm", "Conv")


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    out = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    out[node.output[0]] = numpy_helper.to_array(a.t)
    return out


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _output_axis(consumer: onnx.NodeProto, weight_ndim: int) -> int:
    if consumer.op_type == "Conv":
        return 0
    if consumer.op_type == "Gemm":
        return 0 if _attr(consumer, "transB", 0) else 1
    return weight_ndim - 1  # MatMul: [.., K, N]


def check_qdq(model: onnx.ModelProto) -> list[str]:
    """Violations, one line each (empty when the graph follows the rules)."""
    consts = _constants(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    problems: list[str] = []

    def check_qparams(node: onnx.NodeProto) -> None:
        scale = consts.get(node.input[1])
        if scale is None:
            problems.append(f"{node.name}: scale is not a constant")
        elif not (np.all(np.isfinite(scale)) and np.all(scale > 0)):
            problems.append(f"{node.name}: scales must be positive and finite")
        if len(node.input) < 3 or not node.input[2]:
            problems.append(f"{node.name}: no zero point (the int8 type comes from it)")
            return
        zp = consts.get(node.input[2])
        if zp is None:
            problems.append(f"{node.name}: zero point is not a constant")
        elif zp.dtype != np.int8:
            problems.append(f"{node.name}: zero point type {zp.dtype}, TensorRT takes int8")
        elif np.any(zp != 0):
            problems.append(f"{node.name}: zero points must be 0 (symmetric quantization)")

    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            check_qparams(node)
    for node in model.graph.node:
        if node.op_type not in QUANTIZED_OPS:
            continue
        dq = [producer.get(i) for i in node.input[:2]]
        is_dq = [p is not None and p.op_type == "DequantizeLinear" for p in dq]
        if not any(is_dq):
            continue  # left in fp32
        if not all(is_dq):
            problems.append(f"{node.name}: quantized {node.op_type} lacks DequantizeLinear on input "
                            f"{node.input[is_dq.index(False)]!r}")
            continue
        for k, d in enumerate(dq):
            assert d is not None
            src = d.input[0]
            value = consts.get(src)
            if value is not None:  # a weight
                if value.dtype != np.int8:
                    problems.append(f"{node.name}: weight {src!r} is {value.dtype}, expected int8")
                scale = consts.get(d.input[1])
                if scale is not None and scale.size > 1:
                    axis = _attr(d, "axis", 1) % value.ndim
                    if axis != _output_axis(node, value.ndim):
                        problems.append(f"{node.name}: per-channel weight scale on axis {axis}, "
                                        f"not the output-channel axis {_output_axis(node, value.ndim)}")
                    elif scale.size != value.shape[axis]:
                        problems.append(f"{node.name}: {scale.size} weight scales for {value.shape[axis]} channels")
                continue
            q = producer.get(src)
            if q is None or q.op_type != "QuantizeLinear":
                problems.append(f"{node.name}: input {k} DequantizeLinear does not follow a QuantizeLinear "
                                "or an int8 constant")
                continue
            if q.input[0] in consts:
                problems.append(f"{node.name}: weight {q.input[0]!r} is quantized at run time "
                                "(QuantizeLinear on a constant); store it as int8")
            scale = consts.get(q.input[1])
            if scale is not None and scale.size != 1:
                problems.append(f"{node.name}: activation scale must be per-tensor, has {scale.size} entries")
    return problems
