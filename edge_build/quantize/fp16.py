"""fp16 graphs with onnxruntime's transformer float16 tool (onnxconverter-common
1.16's converter leaves Cast-to-float nodes mistyped on these graphs): fp32 inputs and outputs (but
the ones in FP16_IO), only the ops whose values overflow or lose their meaning in fp16 kept
in fp32 (FP16_KEEP_FP32_OPS and the elementwise tails of their results, `fp32_tails`)."""

from __future__ import annotations

import logging
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
from cosyedge_build.quantize.int8 import external_files, local_copy
from cosyedge_models.errors import MissingExtraError

# What stays fp32 in an fp16 graph (docs/quantization.md): the transcendental ops
# whose arguments or results leave fp16's range or precision (time embedding and
# source phases in Sin/Cos, Exp, Softplus, Pow: x^2 of RMSNorm, Snake's sin^2),
# reductions (sums of many terms pass 65504), and index arithmetic that must stay
# exact. LayerNormalization and Softmax are NOT kept: onnxruntime's CUDA kernels
# accumulate fp16 inputs in fp32 already, and the casts around them (599 in the
# full-size estimator) made the earlier fp16 bundle no faster than fp32 on the H200.
TRANSCENDENTAL_OPS = ("Sin", "Cos", "Exp", "Softplus", "Pow")
REDUCTION_OPS = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                 "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")
EXACT_OPS = ("Range", "CumSum", "TopK", "ArgMax", "ArgMin")
FP16_KEEP_FP32_OPS = TRANSCENDENTAL_OPS + REDUCTION_OPS + EXACT_OPS
# Elementwise ops that continue an fp32 result when every other input is a
# constant (RMSNorm's `+ eps` and Sqrt after its fp32 ReduceMean; a product of two
# fp32 results such as the ISTFT's exp(magnitude) * cos(phase)): casting to fp16
# before them would overflow where the fp32 op was kept for exactly that reason.
TAIL_OPS = ("Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Neg", "Abs", "Clip")
# Ops computed in fp32 where only fp32 nodes read their result (the fp32 op's argument;
# a Constant so kept holds its fp32 value: the rotary frequencies).
ARGUMENT_OPS = TAIL_OPS + ("Constant", "MatMul", "Concat", "Transpose", "Reshape", "Unsqueeze", "Squeeze", "Expand",
                           "Gather", "Slice", "Where", "Cast")
# I/O that fp16 graphs take and give in fp16: the flow estimator's streaming
# K/V cache (the runtime then keeps it in fp16: half the host memory, and no
# cast of the whole cache per call).
FP16_IO: dict[str, tuple[str, ...]] = {"flow_estimator": ("att_cache", "att_cache_new")}


def fp32_nodes_of(graph: onnx.GraphProto, block_nodes: Sequence[str] = (),
                  keep_fp32_ops: Sequence[str] = FP16_KEEP_FP32_OPS) -> list[str]:
    """Names of the nodes an fp16 graph keeps in fp32 besides the FP16_KEEP_FP32_OPS
    ops: `block_nodes`, the elementwise tails of fp32 results (TAIL_OPS whose other
    inputs are constants: RMSNorm's `+ eps` and Sqrt after its ReduceMean, the
    ISTFT's exp(magnitude) * cos(phase)), and the arguments of fp32 ops (nodes of
    ARGUMENT_OPS whose results only fp32 nodes read: rotary and time-embedding
    phases, position * frequency, which fp16 rounds by whole radians past 2048)."""
    names = set(block_nodes)
    keep = set(keep_fp32_ops)
    constants = {i.name for i in graph.initializer}
    constants |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    outputs = {o.name for o in graph.output}

    def fp32(node: onnx.NodeProto) -> bool:
        return node.op_type in keep or node.name in names

    changed = True
    while changed:  # to a fixed point: a tail may start another (eps Add -> Sqrt), arguments chain back
        changed = False
        fp32_out = {o for n in graph.node if fp32(n) for o in n.output}
        for node in graph.node:
            if not node.name or fp32(node):
                continue
            inputs = [i for i in node.input if i]
            tail = (node.op_type in TAIL_OPS and any(i in fp32_out for i in inputs)
                    and all(i in fp32_out or i in constants for i in inputs))
            read = [r for o in node.output for r in readers.get(o, [])]
            argument = (node.op_type in ARGUMENT_OPS and read and not set(node.output) & outputs
                        and all(fp32(r) for r in read))
            if tail or argument:
                names.add(node.name)
                fp32_out.update(node.output)
                changed = True
    return sorted(names - set(block_nodes))


def convert_fp16(src: Path, dst: Path, block_nodes: Sequence[str] = (), fp16_io: Sequence[str] = (),
                 keep_fp32_ops: Sequence[str] = FP16_KEEP_FP32_OPS) -> None:
    """Write `src` in fp16 to `dst`: the ops of `keep_fp32_ops` (the policy; another list
    only to compare policies), the nodes named in `block_nodes` and `fp32_nodes_of`'s
    tails and arguments stay fp32."""
    try:
        from onnxruntime.transformers import float16
    except ImportError as exc:
        raise MissingExtraError("onnxruntime", "build", "fp16 conversion") from exc
    # Its info lines dump whole NodeProtos ("consider adding these nodes to the block list").
    logging.getLogger(float16.__name__).setLevel(logging.WARNING)
    model = load_with_data(src, dst.parent)
    keep: bool | list[str] = True
    if fp16_io:
        g = model.graph
        keep = [v.name for v in (*g.input, *g.output)
                if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT and v.name not in fp16_io]
    op_block = sorted(set(float16.DEFAULT_OP_BLOCK_LIST) | set(keep_fp32_ops))
    node_block = list(block_nodes) + fp32_nodes_of(model.graph, block_nodes, keep_fp32_ops)
    converted = float16.convert_float_to_float16(model, keep_io_types=keep, op_block_list=op_block,
                                                 node_block_list=node_block)
    drop_repeated_casts(converted.graph)
    fold_cast_round_trips(converted)
    unique_node_names(converted.graph)
    # The converter appends the input casts after the nodes that read them; onnxruntime
    # accepts that, but the ONNX spec and TensorRT's parser need the nodes in order.
    topological_sort(converted.graph)
    big = converted.ByteSize() > (1 << 30)
    onnx.save(converted, str(dst), save_as_external_data=big,
              location=dst.name + ".data" if big else None)


def precision_summary(model: onnx.ModelProto) -> dict[str, Any]:
    """What an fp16 graph computes in which precision: its node and Cast counts and,
    by op type, the nodes computing in fp32 (float inputs all fp32) and in fp16 (shape
    and index nodes, which read no float, are in neither). Recorded in the build's
    report; what the tests check about the policy."""
    f32, f16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    types = _tensor_types(model)
    g = model.graph
    fp32: Counter[str] = Counter()
    fp16: Counter[str] = Counter()
    for node in g.node:
        if node.op_type in ("Cast", "Constant"):
            continue
        kinds = {types.get(i) for i in node.input if i} & {f32, f16}
        if kinds == {f32}:
            fp32[node.op_type] += 1
        elif f16 in kinds:
            fp16[node.op_type] += 1
    return {"nodes": len(g.node), "casts": sum(n.op_type == "Cast" for n in g.node),
            "fp32_ops": dict(sorted(fp32.items())), "fp16_ops": dict(sorted(fp16.items()))}


def _tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    g = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.output, *g.value_info)}
    types |= {i.name: i.data_type for i in g.initializer}
    for node in g.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].type == onnx.AttributeProto.TENSOR:
            types[node.output[0]] = node.attribute[0].t.data_type
    return types


def fold_cast_round_trips(model: onnx.ModelProto) -> int:
    """Remove the converter's fp16 round trips between fp32 nodes, Cast(Cast(x, fp16), fp32):
    it casts every blocked node's result to fp16 and back for the next blocked node, which
    costs two kernels and rounds (or overflows) the very value kept in fp32. The second
    Cast then reads x (or is dropped where x is fp32 already); an fp16 Cast nobody reads
    any more goes too. How many Casts were removed."""
    graph = model.graph
    types = _tensor_types(model)
    producer = {o: n for n in graph.node for o in n.output}
    outputs = {o.name for o in graph.output}
    rename: dict[str, str] = {}
    drop: set[int] = set()
    for node in graph.node:
        first = producer.get(node.input[0]) if node.op_type == "Cast" and node.input else None
        if (first is None or first.op_type != "Cast" or _cast_to(node) != onnx.TensorProto.FLOAT
                or _cast_to(first) != onnx.TensorProto.FLOAT16):
            continue
        source = first.input[0]
        if types.get(source) == onnx.TensorProto.FLOAT and node.output[0] not in outputs:
            rename[node.output[0]] = source
            drop.add(id(node))
        else:
            node.input[0] = source
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name in rename:
                node.input[k] = rename[name]
    read = {i for n in graph.node if id(n) not in drop for i in n.input} | outputs
    for node in graph.node:
        if node.op_type == "Cast" and _cast_to(node) == onnx.TensorProto.FLOAT16 and node.output[0] not in read:
            drop.add(id(node))
    keep = [n for n in graph.node if id(n) not in drop]
    removed = len(graph.node) - len(keep)
    if removed:
        del graph.node[:]
        graph.node.extend(keep)
    return removed


def _cast_to(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "to"), 0)


def topological_sort(graph: onnx.GraphProto) -> bool:
    """Order `graph.node` so that every node comes after the nodes whose outputs it reads
    (each node is placed after its producers, otherwise in its old order); returns whether
    it changed."""
    nodes = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    state = [0] * len(nodes)  # 0 not placed, 1 being placed, 2 placed
    order: list[int] = []
    for start in range(len(nodes)):
        stack = [(start, False)]
        while stack:
            i, expanded = stack.pop()
            if expanded:
                state[i] = 2
                order.append(i)
                continue
            if state[i] == 2:
                continue
            if state[i] == 1:
                raise ValueError(f"graph {graph.name}: node {nodes[i].name} is part of a cycle")
            state[i] = 1
            stack.append((i, True))
            stack += [(producer[t], False) for t in reversed(nodes[i].input) if t in producer
                      and state[producer[t]] != 2]
    if order == list(range(len(nodes))):
        return False
    copies = [onnx.NodeProto() for _ in order]
    for c, i in zip(copies, order, strict=True):
        c.CopyFrom(nodes[i])
    del graph.node[:]
    graph.node.extend(copies)
    return True


def load_with_data(src: Path, scratch: Path) -> onnx.ModelProto:
    """`src` with its external data, read from a copy under `scratch` (int8.local_copy:
    onnx refuses the shared llm_weights.bin once other bundles hard-link it)."""
    model = onnx.load(str(src), load_external_data=False)
    if not external_files(src, model):
        return model
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".fp16-") as tmp:
        return onnx.load(str(local_copy(src, model, Path(tmp))))


def drop_repeated_casts(graph: onnx.GraphProto) -> int:
    """Remove nodes that repeat an earlier node exactly (same op, inputs, outputs and
    attributes), and repeated value_info entries; how many nodes were removed.
    onnxruntime 1.31's converter puts one Cast in front of every blocked consumer of a
    float16 tensor, all of them named and writing `<tensor>_cast_to_fp32`: the same
    tensor defined twice, which onnxruntime refuses ("Duplicate definition of name",
    seen on the H200). The repeats compute the same value, so one is kept (1.32's
    converter shares one Cast the same way)."""
    seen: set[bytes] = set()
    keep: list[onnx.NodeProto] = []
    for node in graph.node:
        key = onnx.NodeProto(op_type=node.op_type, domain=node.domain, input=node.input, output=node.output,
                             attribute=node.attribute).SerializeToString(deterministic=True)
        if key in seen:
            continue
        seen.add(key)
        keep.append(node)
    removed = len(graph.node) - len(keep)
    if removed:
        del graph.node[:]
        graph.node.extend(keep)
    names: set[str] = set()
    infos = [v for v in graph.value_info if not (v.name in names or names.add(v.name))]  # type: ignore[func-returns-value]
    if len(infos) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(infos)
    return removed


def unique_node_names(graph: onnx.GraphProto) -> int:
    """Rename repeated node names (in subgraphs too); how many were renamed. onnxruntime
    1.31's converter names the Cast it puts in front of a blocked node after the tensor
    it casts, so two blocked consumers of one tensor got two nodes of one name, which
    onnxruntime then refuses to load ("two nodes with same node name", seen on the
    H200). Names carry no meaning beyond being unique."""
    seen: set[str] = {n.name for n in _all_nodes(graph)}
    counts: dict[str, int] = {}
    renamed = 0
    for node in _all_nodes(graph):
        if not node.name:
            continue
        counts[node.name] = counts.get(node.name, 0) + 1
        if counts[node.name] == 1:
            continue
        n = counts[node.name]
        while f"{node.name}_{n}" in seen:
            n += 1
        counts[node.name] = n
        node.name = f"{node.name}_{n}"
        seen.add(node.name)
        renamed += 1
    return renamed


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes.append(node)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                nodes.extend(_all_nodes(attr.g))
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    nodes.extend(_all_nodes(g))
    return nodes
