"""How each stage's TensorRT engine is built, decided from its ONNX graph and
the manifest, without TensorRT: precision mode, builder flags, layers pinned
to fp32, optimization profiles (capped for Jetson memory), workspace size.

The precision rule (`precision_mode`):

* The graph carries float16 tensors (an fp16 bundle, or an INT8 bundle whose
  quantizer kept layers in fp16/fp32 by explicit casts): build a STRONGLY
  TYPED network. The graph's types are the precision policy (the fp32
  islands around normalization, softmax, the time embedding, the F0
  predictor exist because fp16 overflows there); a weakly typed build with
  the FP16 flag may move those layers back to fp16 and re-create the NaNs.
  TensorRT forbids precision flags on strongly typed networks; Q/DQ nodes
  carry INT8 by themselves.
* Otherwise, the graph has Q/DQ nodes (INT8 explicit quantization of an fp32
  graph, as onnxruntime.quantization writes it): weakly typed with the INT8
  and FP16 flags, so the quantized ops run in INT8 and the rest may use
  FP16; the nodes the quantizer's sensitivity pass lists in the stage's
  `fp32_nodes` are pinned to fp32 (layer precision + output types, with
  OBEY_PRECISION_CONSTRAINTS).
* Otherwise (a plain fp32 graph): weakly typed, no precision flags (TF32
  where the GPU has it).
"""

from __future__ import annotations

import re
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
    strongly_typed: bool
    flags: tuple[str, ...]  # BuilderFlag names
    fp32_nodes: tuple[str, ...]
    reason: str


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
    if graph_has_fp16(model):
        return PrecisionMode(True, (), (), "the graph carries fp16 tensors: its types are the precision policy, "
                                           "so the network is strongly typed (no precision flags)")
    if graph_has_qdq(model):
        names = {n.name for n in model.graph.node}
        unknown = [n for n in fp32_nodes if n not in names]
        if unknown:
            raise BundleError(f"manifest fp32_nodes names nodes the graph lacks: {unknown[:5]}")
        flags = ("INT8", "FP16", "OBEY_PRECISION_CONSTRAINTS") if fp32_nodes else ("INT8", "FP16")
        return PrecisionMode(False, flags, tuple(fp32_nodes),
                             "fp32 graph with Q/DQ: weakly typed, INT8 + FP16, sensitive nodes pinned to fp32")
    return PrecisionMode(False, (), (), "plain fp32 graph: weakly typed, no precision flags")


_ONNX_META = re.compile(r"\[ONNX Layer: ([^\]]+)\]")
_SUFFIX = re.compile(r"^(.*)_(\d+)$")


def onnx_node_of(layer_name: str, metadata: str, nodes: set[str]) -> str | None:
    """The ONNX node a TensorRT layer came from: the parser names a node's
    first layer after the node and further ones `<node>_<n>`, and (TensorRT
    10) records `[ONNX Layer: <node>]` in the layer metadata."""
    if layer_name in nodes:
        return layer_name
    for name in _ONNX_META.findall(metadata or ""):
        if name in nodes:
            return name
    m = _SUFFIX.match(layer_name)
    if m and m.group(1) in nodes:
        return m.group(1)
    return None


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
