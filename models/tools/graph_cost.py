"""What each stage computes and moves per call, counted from its ONNX graph
(for the Jetson projection, models/tools/projection.py).

Weight FLOPs come from the graph: every MatMul / Gemm / Conv / ConvTranspose
whose weight is an initializer (directly or through DequantizeLinear,
Transpose, Cast) counts 2 x its weight's elements per output row or
position. How many rows a node sees per call follows from the time axis: the
stage's time inputs have rate 1 (tokens for the LLM and the flow encoder, mel
frames for the estimator and the vocoder, 480 per frame for the vocoder's
source), a strided Conv divides the rate, a ConvTranspose and an upsampling
Resize multiply it, any other node takes the highest rate of its inputs.
Attention (activation x activation) is added from the manifest's dimensions,
since its sizes depend on the cache length of the call.

Reads graphs without their weight data (`onnx`, a build-extra package,
imported lazily)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyedge_models.errors import MissingExtraError
from cosyedge_models.tools.projection import StageCost, Workload

WEIGHT_PASS = ("DequantizeLinear", "Transpose", "Cast", "Identity", "Reshape", "Unsqueeze")


@dataclass(frozen=True)
class GraphWeights:
    """Per-call weight FLOPs of a graph as a function of the time units (T) per call."""

    per_unit_flops: float  # FLOPs for each time unit (rows that scale with T)
    fixed_flops: float  # FLOPs of nodes outside the time axis (once per call and batch row)
    params: float  # weight elements of the counted nodes


def _onnx() -> Any:
    try:
        import onnx
    except ImportError as exc:
        raise MissingExtraError("onnx", "build", "the Jetson projection (counting FLOPs from the graphs)") from exc
    return onnx


def _attr(node: Any, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return list(a.ints) if a.ints else (a.i if a.type == 2 else a.f)
    return default


def _const_values(graph: Any) -> dict[str, list[float]]:
    from onnx import numpy_helper

    out: dict[str, list[float]] = {}
    for t in graph.initializer:
        if t.data_location != 1 and int(math.prod(t.dims)) <= 16:
            out[t.name] = numpy_helper.to_array(t).reshape(-1).astype(float).tolist()
    for n in graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and int(math.prod(a.t.dims)) <= 16:
                    out[n.output[0]] = numpy_helper.to_array(a.t).reshape(-1).astype(float).tolist()
    return out


def graph_weights(model: Any, time_inputs: Mapping[str, float]) -> GraphWeights:
    graph = model.graph
    dims = {t.name: [int(d) for d in t.dims] for t in graph.initializer}
    weight: dict[str, list[int]] = dict(dims)
    consts = _const_values(graph)
    rate: dict[str, float] = dict(time_inputs)
    per_unit = fixed = params = 0.0
    for node in graph.node:
        ins = [i for i in node.input if i]
        if node.op_type in WEIGHT_PASS and ins and ins[0] in weight:
            for o in node.output:
                weight[o] = weight[ins[0]]
            continue
        rates = [rate[i] for i in ins if i in rate]
        r_in = max(rates) if rates else None
        r_out = r_in
        if r_in is not None and node.op_type == "Conv":
            r_out = r_in / float((_attr(node, "strides", [1]) or [1])[-1])
        elif r_in is not None and node.op_type == "ConvTranspose":
            r_out = r_in * float((_attr(node, "strides", [1]) or [1])[-1])
        elif r_in is not None and node.op_type in ("Resize", "Upsample"):
            scales = next((consts[i] for i in ins[1:] if i in consts and consts[i]), None)
            if scales:
                r_out = r_in * float(scales[-1])
        if r_out is not None:
            for o in node.output:
                rate[o] = r_out
        if node.op_type in ("MatMul", "Gemm", "Conv", "ConvTranspose") and len(ins) > 1 and ins[1] in weight:
            size = float(math.prod(weight[ins[1]]))
            flops = 2.0 * size
            params += size
            positions = r_in if node.op_type == "ConvTranspose" else r_out
            if positions is None:
                fixed += flops
            else:
                per_unit += flops * positions
    return GraphWeights(per_unit, fixed, params)


def load_graph(path: Path) -> Any:
    return _onnx().load(str(path), load_external_data=False)


# --- the stage calls of one streaming request ----------------------------------------------------------


@dataclass(frozen=True)
class RequestShape:
    """The request the projection prices (defaults: the engine's streaming defaults)."""

    prompt_tokens: int = 30  # sos + text + task (+ a zero-shot voice's prompt text and speech tokens)
    utterance_seconds: float = 10.0
    first_hop_tokens: int | None = None  # None: the bundle's streaming token_hop_len


def _llm_call(stage: str, w: GraphWeights, llm: Mapping[str, Any], tokens: int, past: float) -> StageCost:
    n_l, hkv, hd = int(llm["num_layers"]), int(llm["num_kv_heads"]), int(llm["head_dim"])
    hq = int(llm["num_heads"])
    attention = 4.0 * n_l * hq * hd * tokens * (past + tokens)
    kv = 2.0 * n_l * hkv * hd * (past + tokens)  # cache read + the new rows written
    return StageCost(stage, w.per_unit_flops * tokens + w.fixed_flops + attention, w.params,
                     kv + tokens * (int(llm["hidden_size"]) + int(llm["speech_vocab_size"])))


def _estimator_call(w: GraphWeights, cache: Mapping[str, Any], frames: int, cached: float, batch: int) -> StageCost:
    blocks, inner = int(cache.get("blocks", 0)), int(cache.get("heads", 0)) * int(cache.get("head_dim", 0))
    attention = 4.0 * blocks * inner * frames * (cached + frames) * batch
    kv = 2.0 * blocks * inner * (cached + frames) * batch
    return StageCost("flow_estimator", (w.per_unit_flops * frames + w.fixed_flops) * batch + attention, w.params,
                     kv + 4 * 80 * frames * batch)


def _encoder_call(w: GraphWeights, cache: Mapping[str, Any], tokens: int, cached: float) -> StageCost:
    inner = int(cache.get("heads", 0)) * int(cache.get("head_dim", 0))
    layers, up = int(cache.get("layers", 0)), int(cache.get("up_layers", 0))
    attention = 4.0 * inner * (layers * tokens * (cached + tokens) + up * 4 * tokens * (cached + tokens))
    kv = 2.0 * inner * (layers * (cached + tokens) + up * 2 * (cached + tokens))
    return StageCost("flow_encoder", w.per_unit_flops * tokens + w.fixed_flops + attention, w.params,
                     kv + 2 * 80 * 2 * tokens)


def _plain_call(stage: str, w: GraphWeights, units: float, io: float) -> StageCost:
    return StageCost(stage, w.per_unit_flops * units + w.fixed_flops, w.params, io)


def bundle_workload(root: Path, manifest: Mapping[str, Any], shape: RequestShape | None = None) -> Workload:
    """The stage calls of the first audio and of one second of audio of a
    streaming request on the bundle at `root` (fp32 graphs: the counts do
    not depend on the precision)."""
    shape = shape or RequestShape()
    stages = manifest["stages"]
    llm, flow = manifest["llm"], manifest.get("flow", {})
    tokens_per_s = int(manifest.get("token_rate_hz", 25))
    ratio = int(manifest.get("token_mel_ratio", 2))
    upsample = int(manifest.get("hift", {}).get("upsample_factor", 480))
    steps = int(flow.get("n_timesteps", 10))
    lookahead = int(flow.get("pre_lookahead_len", 3))
    hop = shape.first_hop_tokens or int(manifest.get("streaming", {}).get("token_hop_len", 25))

    def weights(stage: str, time_inputs: Mapping[str, float]) -> GraphWeights:
        return graph_weights(load_graph(root / stages[stage]["file"]), time_inputs)

    prefill = weights("llm_prefill", {"inputs_embeds": 1.0})
    decode = weights("llm_decode", {"inputs_embeds": 1.0})
    encoder = weights("flow_encoder", {"token": 1.0})
    estimator = weights("flow_estimator", {n: 1.0 for n in ("x", "mu", "cond", "mask")})
    source = weights("hift_source", {"mel": 1.0, "noise": float(upsample)})
    vocoder = weights("hift_decoder", {"mel": 1.0, "source": float(upsample)})
    enc_cache = stages["flow_encoder"].get("cache") or {}
    est_cache = stages["flow_estimator"].get("cache") or {}

    first_tokens = hop + lookahead
    first_frames = first_tokens * ratio
    p0 = shape.prompt_tokens
    first = {
        "llm_prefill": [(_llm_call("llm_prefill", prefill, llm, p0, 0), 1.0)],
        "llm_decode": [(_llm_call("llm_decode", decode, llm, 1, p0 + first_tokens / 2), float(first_tokens))],
        "flow_encoder": [(_encoder_call(encoder, enc_cache, first_tokens, 0), 1.0)],
        "flow_estimator": [(_estimator_call(estimator, est_cache, first_frames, 0, 2), float(steps))],
        "vocoder": [(_plain_call("hift_source", source, first_frames, first_frames * upsample * 10), 1.0),
                    (_plain_call("hift_decoder", vocoder, first_frames, first_frames * (80 + upsample)), 1.0)],
    }
    # one second in the middle of the utterance: caches half full
    mid_tokens = tokens_per_s * shape.utterance_seconds / 2
    frames = tokens_per_s * ratio
    per_second = {
        "llm_decode": [(_llm_call("llm_decode", decode, llm, 1, p0 + mid_tokens), float(tokens_per_s))],
        "flow_encoder": [(_encoder_call(encoder, enc_cache, tokens_per_s, mid_tokens), 1.0)],
        "flow_estimator": [(_estimator_call(estimator, est_cache, frames, mid_tokens * ratio, 2), float(steps))],
        "vocoder": [(_plain_call("hift_source", source, frames, frames * upsample * 10), 1.0),
                    (_plain_call("hift_decoder", vocoder, frames, frames * (80 + upsample)), 1.0)],
    }
    return Workload(first, per_second)
