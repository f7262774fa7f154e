"""Which nodes of which stage graph are quantized: the quantizable op types,
the op types always kept in fp32, and the node groups the sensitivity pass
switches on and off (matched on the exporter's node names)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import onnx

# ConvTranspose stays fp32: its per-channel axis is 1, which TensorRT's
# explicit quantization of deconvolutions does not take from ONNX Q/DQ reliably.
QUANT_OPS = ("MatMul", "Gemm", "Conv")
# Normalization, softmax and the transcendental functions (time embedding,
# Snake activations, RMSNorm's x^2) lose too much in int8/fp16: pinned to fp32.
FP32_OPS = ("LayerNormalization", "Softmax", "ReduceMean", "Pow", "Sqrt", "Reciprocal", "Exp", "Sin", "Cos",
            "Softplus", "Erf")


@dataclass(frozen=True)
class UnitPolicy:
    """One quantization unit: graphs sharing weights (LLM prefill + decode)
    quantized with the same node selection."""

    name: str
    stages: tuple[str, ...]
    groups: tuple[tuple[str, str], ...]  # (group, regex on the node name); first match wins
    always_fp32: tuple[str, ...]  # groups never quantized

    def group_of(self, node_name: str) -> str:
        for group, pattern in self.groups:
            if re.search(pattern, node_name):
                return group
        return "other"


UNITS: tuple[UnitPolicy, ...] = (
    UnitPolicy(
        name="llm", stages=("llm_prefill", "llm_decode"),
        groups=(("attn_proj", r"/(q|k|v|o)_proj"), ("mlp", r"/(gate|up|down)_proj"), ("head", r"/head/"),
                ("attn_scores", r"^/MatMul(_\d+)?$")),
        always_fp32=(),
    ),
    UnitPolicy(
        name="flow", stages=("flow_estimator",),
        groups=(("time_embedding", r"time_mlp|time_emb"), ("final_proj", r"final_(block|proj)"),
                ("attn_proj", r"/to_(q|k|v|out)"), ("attn_scores", r"^/MatMul(_\d+)?$"), ("ff", r"/ff/"),
                ("resnet", r"block[12]|res_conv|/mlp/"), ("resample", r"_blocks\.\d+\.2/")),
        always_fp32=("time_embedding",),
    ),
    UnitPolicy(
        name="vocoder", stages=("hift_decoder",),
        groups=(("stft", r"^/Conv$|^/ConvTranspose"), ("conv_pre", r"conv_pre"), ("conv_post", r"conv_post"),
                ("source_path", r"source_"), ("resblocks", r"/resblocks\.")),
        always_fp32=("stft",),
    ),
)
# Stages never quantized: hift_source (F0 predictor + sine source: phase
# accumulation breaks in low precision) and the flow encoder (run once per
# chunk, small next to the estimator's 2 x n_timesteps evaluations).
FP32_STAGES = ("flow_encoder", "hift_source")


def unit(name: str) -> UnitPolicy:
    for u in UNITS:
        if u.name == name:
            return u
    raise KeyError(name)


def quantizable_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type in QUANT_OPS]


def groups_in(policy: UnitPolicy, model: onnx.ModelProto) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for node in quantizable_nodes(model):
        out.setdefault(policy.group_of(node.name), []).append(node.name)
    return out


def fp32_node_names(model: onnx.ModelProto, excluded: Sequence[str]) -> list[str]:
    """The manifest's `fp32_nodes`: the excluded quantizable nodes plus every
    node of an always-fp32 op type."""
    wanted = set(excluded)
    return [n.name for n in model.graph.node if n.name in wanted or n.op_type in FP32_OPS]
