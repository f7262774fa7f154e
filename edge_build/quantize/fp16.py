"""fp16 graphs with onnxruntime's transformer float16 tool (onnxconverter-common
1.16's converter leaves Cast-to-float nodes mistyped on these graphs): fp32 inputs and outputs (but
the ones in FP16_IO), the ops that overflow in fp16 kept in fp32."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import onnx
from cosyedge_build.quantize.int8 import external_files, local_copy
from cosyedge_build.quantize.policy import FP32_OPS
from cosyedge_models.errors import MissingExtraError

# Besides FP32_OPS: index and shape arithmetic that must stay exact, and
# reductions whose sums overflow fp16's 65504.
FP16_BLOCK_OPS = tuple(FP32_OPS) + ("Range", "CumSum", "ReduceSum", "ReduceMax", "TopK", "ArgMax")
# I/O that fp16 graphs take and give in fp16: the flow estimator's streaming
# K/V cache (the runtime then keeps it in fp16: half the host memory, and no
# cast of the whole cache per call).
FP16_IO: dict[str, tuple[str, ...]] = {"flow_estimator": ("att_cache", "att_cache_new")}


def convert_fp16(src: Path, dst: Path, block_nodes: Sequence[str] = (), fp16_io: Sequence[str] = ()) -> None:
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
    op_block = sorted(set(float16.DEFAULT_OP_BLOCK_LIST) | set(FP16_BLOCK_OPS))
    converted = float16.convert_float_to_float16(model, keep_io_types=keep, op_block_list=op_block,
                                                 node_block_list=list(block_nodes))
    drop_repeated_casts(converted.graph)
    unique_node_names(converted.graph)
    # The converter appends the input casts after the nodes that read them; onnxruntime
    # accepts that, but the ONNX spec and TensorRT's parser need the nodes in order.
    topological_sort(converted.graph)
    big = converted.ByteSize() > (1 << 30)
    onnx.save(converted, str(dst), save_as_external_data=big,
              location=dst.name + ".data" if big else None)


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
