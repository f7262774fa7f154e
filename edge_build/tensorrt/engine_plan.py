"""How each stage's TensorRT engine is built, decided from its ONNX graph and
the manifest, without TensorRT: precision, optimization profiles (capped for
Jetson memory), workspace size.

The precision rule (`precision_mode`): every engine is a STRONGLY TYPED
network built with no precision builder flags, so the ONNX graph's types are
the precision policy and one build path serves TensorRT 10.3 (JetPack 6.2),
10.13 (JetPack 7.0) and 11 (where the weak-typing API, BuilderFlag.INT8/FP16,
OBEY_PRECISION_CONSTRAINTS, ILayer.precision and set_output_type, is gone;
deprecated since 10.12):

* fp16: the bundle's fp16 graphs carry float16 tensors by casts, with the
  overflow-prone nodes (normalization, softmax, the time embedding, the F0
  predictor) kept in float32 by the converter's block list; TensorRT runs
  each layer in the type the graph gives it, so those islands stay fp32.
* int8: the bundle's Q/DQ graphs (explicit quantization, as
  onnxruntime.quantization writes it): a strongly typed network runs the
  quantized ops in INT8 and every other layer in the graph's type (fp32), so
  the nodes the quantizer's sensitivity pass kept out of INT8 (`fp32_nodes`)
  stay fp32 by construction, with nothing to pin.
* a plain fp32 graph: fp32 (TF32 where the GPU has it, TensorRT's default).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx
from cosyedge_models.backends.profiles import ShapeRange, all_input_ranges, cap_profile, input_ranges, stage_profiles
from cosyedge_models.bundle.loader import FIXED_SHAPE_PREFIXES, STAGES
from cosyedge_models.bundle.memory_budget import BOARDS, MIB, Board
from cosyedge_models.errors import BundleError

QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}


@dataclass(frozen=True)
class PrecisionMode:
    """What the graph's types make of an engine; the network is always strongly typed."""

    carried_by: str  # "fp16 casts", "Q/DQ", "Q/DQ and fp16 casts" or "fp32"
    fp32_nodes: tuple[str, ...]  # the quantizer's fp32 nodes (fp32 in the graph itself)
    reason: str
    strongly_typed: bool = True


def graph_has_fp16(model: onnx.ModelProto) -> bool:
    g = model.graph
    fp16 = onnx.TensorProto.FLOAT16
    if any(t.data_type == fp16 for t in g.initializer):
        return True
    for vi in (*g.input, *g.output, *g.value_info):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type == fp16:
            return True
    for node in g.node:
        if node.op_type == "Cast" and any(a.name == "to" and a.i == fp16 for a in node.attribute):
            return True
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and a.t.data_type == fp16:
                    return True
    return False


def graph_has_qdq(model: onnx.ModelProto) -> bool:
    return any(n.op_type in QDQ_OPS for n in model.graph.node)


def precision_mode(model: onnx.ModelProto, fp32_nodes: Sequence[str] = ()) -> PrecisionMode:
    names = {n.name for n in model.graph.node}
    unknown = [n for n in fp32_nodes if n not in names]
    if unknown:
        raise BundleError(f"manifest fp32_nodes names nodes the graph lacks: {unknown[:5]}")
    fp16, qdq = graph_has_fp16(model), graph_has_qdq(model)
    if fp16 and qdq:
        return PrecisionMode("Q/DQ and fp16 casts", tuple(fp32_nodes),
                             "Q/DQ over fp16: INT8 where quantized, fp16/fp32 as the graph's casts say")
    if fp16:
        return PrecisionMode("fp16 casts", tuple(fp32_nodes),
                             "the graph's casts: fp16 layers, its fp32 islands fp32")
    if qdq:
        return PrecisionMode("Q/DQ", tuple(fp32_nodes),
                             "Q/DQ: the quantized ops in INT8, every other layer fp32 as the graph says")
    return PrecisionMode("fp32", tuple(fp32_nodes), "plain fp32 graph")


def onnx_input_specs(model: onnx.ModelProto) -> list[dict[str, Any]]:
    """Graph inputs as manifest-style specs: dims are ints or their dim_param names."""
    inits = {t.name for t in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims: list[int | str] = []
        for d in vi.type.tensor_type.shape.dim:
            dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?"))
        out.append({"name": vi.name, "shape": dims})
    return out


def build_profiles(entry: Mapping[str, Any], stage: str, model: onnx.ModelProto | None,
                   caps: Mapping[str, int] | None = None) -> list[dict[str, ShapeRange]]:
    """The TensorRT optimization profiles of a stage: the manifest's ranges,
    capped, over the manifest's input shapes (or the ONNX graph's)."""
    profiles = stage_profiles(entry, stage)
    if caps:
        profiles = [cap_profile(p, caps) for p in profiles]
    inputs = entry.get("inputs")
    if not (isinstance(inputs, list) and inputs and all("shape" in i for i in inputs)):
        if model is None:
            return all_input_ranges(entry, stage)
        inputs = onnx_input_specs(model)
    return [input_ranges(inputs, p, stage) for p in profiles]


def prefill_profiles(decode_entry: Mapping[str, Any]) -> list[int]:
    """Indices of llm_decode's profiles that can run a prefill (an empty past, P = 0, and
    more than one new position): where there are any, one engine built from llm_decode
    serves the prefill too and no llm_prefill engine is built (one copy of the weights)."""
    return [i for i, p in enumerate(stage_profiles(decode_entry, "llm_decode"))
            if "P" in p and "T" in p and p["P"][0] == 0 and p["T"][2] > 1]


def is_fixed_shape(stage: str) -> bool:
    """A fixed-shape stage (FIXED_SHAPE_PREFIXES: flow estimator windows, vocoder lengths,
    flow encoder windows): every input static, optional in the engines section."""
    return stage.startswith(FIXED_SHAPE_PREFIXES)


def engine_stages(requested: Sequence[str] | None, available: Iterable[str]) -> tuple[str, ...]:
    """What `build engines` builds: by default (None) the six dynamic STAGES and every
    fixed-shape stage of the bundle (`available`: its stage names), else `requested`,
    each of which must be one of those."""
    fixed = sorted(n for n in available if is_fixed_shape(n))
    if requested is None:
        return (*STAGES, *fixed)
    unknown = [s for s in requested if s not in STAGES and s not in fixed]
    if unknown:
        raise BundleError(f"unknown stages {unknown}; allowed: {', '.join((*STAGES, *fixed))}")
    return tuple(requested)


def workspace_bytes(board: str | None, workspace_mib: int | None) -> int:
    """The builder's WORKSPACE pool limit: explicit, else the board's default
    (512 MiB on an Orin Nano 8 GB, whose DRAM the CPU shares), else 1 GiB."""
    if workspace_mib is not None:
        if workspace_mib < 16:
            raise ValueError(f"workspace must be at least 16 MiB, got {workspace_mib}")
        return workspace_mib * MIB
    return resolve_board(board).default_workspace_bytes if board else 1024 * MIB


def resolve_board(key: str) -> Board:
    if key not in BOARDS:
        raise ValueError(f"unknown board {key!r}; allowed: {', '.join(BOARDS)}")
    return BOARDS[key]


def batch_caps(profiles: Iterable[Mapping[str, tuple[int, int, int]]], max_batch: int | None) -> dict[str, int]:
    """Caps for the batch symbols (B, N: N = 2 x requests for the flow's CFG)."""
    if max_batch is None:
        return {}
    syms = {s for p in profiles for s in p}
    caps = {}
    if "B" in syms:
        caps["B"] = max_batch
    if "N" in syms:
        caps["N"] = 2 * max_batch
    return caps
