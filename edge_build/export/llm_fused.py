"""The LLM decode step as an onnxruntime-fused graph with a batch of slot rows
(`llm_decode_fused_b<B>`, one file per batch size B, every shape fixed so
that ort-cuda captures each size once).

Written node by node from the upstream layers' weights (not traced): each
layer is one packed QKV MatMul + bias, one `com.microsoft` GroupQueryAttention
that applies the rotary embedding itself from precomputed cos/sin caches
(`do_rotary`) and writes the new K/V into the cache in place, the output
projection, `SkipSimplifiedLayerNormalization` (residual add + RMS norm in
one kernel), and the SwiGLU MLP with `QuickGelu(alpha=1)` = SiLU.

The KV cache is one buffer per bundle, `[L, 2, R, Hkv, C, hd]` (R slot rows,
C positions); the runtime binds `past_key_<i>` / `present_key_<i>` (and the
values) of a B-row step to the SAME memory, the view `[i, 0|1, 0:B]`, so
GroupQueryAttention updates it in place (past/present share one buffer).

Inputs: `inputs_embeds` [B, 1, D] float32; `seqlens_k` [B] int32, the new
token's position in its row (= the row's cached length before the step);
`past_key_<i>`, `past_value_<i>` [B, Hkv, C, hd]. Outputs: `logp` [B, V]
float32; `present_key_<i>`, `present_value_<i>` (the same buffers). An idle
row (in the step's batch, not stepping) gets `seqlens_k` = C - 1: it writes
its K/V at the last position, which no stream uses (a stream holds at most
C - 1 positions), and its logp is dropped. (GroupQueryAttention's
`query_seqlens` input, which would skip such rows, is new in onnxruntime 1.32;
the device's onnxruntime-gpu 1.31 refuses a graph that uses it.)

Precision (`export_fused_decode(precision=)`, `build export
--fused-decode-precision`): "fp32", or "fp16", which onnxruntime's CUDA
provider needs: its GroupQueryAttention kernel is registered for float16 and
bfloat16 only (onnxruntime/contrib_ops/cuda/bert/group_query_attention.cc,
REGISTER_KERNEL_TYPED(MLFloat16, ...) / (BFloat16, ...); onnxruntime-genai's
model builder uses GQA on CUDA only with float16 I/O, "GQA is not currently
supported for FP32 CUDA", microsoft/onnxruntime-genai#420), so an fp32 graph
would run every attention on the CPU provider. The fp16 graph is the fp32 one
through the project's fp16 policy (edge_build/quantize/fp16.py): weights,
rotary caches, norms, MatMuls, attention and the KV cache in fp16; the final
LogSoftmax (exp and a sum over the vocabulary) in fp32; `inputs_embeds` stays
a float32 input and `logp` a float32 output, so the sampler is unchanged. The
rotary caches are computed in float32 and rounded once (values in [-1, 1]).
`llm_fused_kv_insert` then casts a prefill's float32 cache into the fp16 rows.
The stage entry's `kv_cache.dtype` is the buffer's dtype.

The plain graphs (llm.py) stay for TensorRT, which cannot parse onnxruntime's
contrib operators."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_build.export.graphs import StageGraph, TensorSpec
from cosyedge_build.export.llm import llm_dims
from cosyedge_build.reference.modules import require
from cosyedge_models.batching.fused_step import (  # the names the runtime looks for
    FUSED_PREFILL_PREFIX,
    FUSED_PREFIX,
    INSERT_ROW,
    KV_INSERT,
)
from cosyedge_models.errors import CheckpointError

log = logging.getLogger(__name__)

LOGP_NODE = "logp"
MS_DOMAIN = "com.microsoft"
FUSED_DECODE_LEN = 1536  # default cache positions: a 512-position prompt and 1,024 speech tokens
# opset 17's IR version: onnx 1.23's helper writes 14, which the device's onnxruntime-gpu 1.31 refuses
IR_VERSION = 8
PRECISIONS = ("fp32", "fp16")
KV_DTYPES = {"fp32": "float32", "fp16": "float16"}


def fused_stage_name(batch: int) -> str:
    return f"{FUSED_PREFIX}{batch}"


def fused_prefill_name(length: int) -> str:
    return f"{FUSED_PREFILL_PREFIX}{length}"


def _np(t: Any) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float32)


def rope_caches(llm: Any, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [C, hd/2] for positions 0..C-1, computed in float32 the way the
    plain graphs compute them (llm.py: positions * inv_freq, then cos/sin,
    times the RoPE attention scaling)."""
    torch = require("torch", "torch", "exporting the LLM")
    rotary = llm.llm.model.model.rotary_emb
    inv_freq = rotary.inv_freq.detach().clone().float()
    freqs = torch.arange(positions).unsqueeze(-1).float() * inv_freq  # [C, hd/2]
    scale = float(rotary.attention_scaling)
    return _np(freqs.cos() * scale), _np(freqs.sin() * scale)


def build_fused_decode(llm: Any, batch: int, positions: int) -> tuple[Any, StageGraph]:
    """The ONNX model of one B-row step over a C-position cache, and its stage spec."""
    return _build_fused(llm, batch, 1, positions)


def build_fused_prefill(llm: Any, length: int, positions: int) -> tuple[Any, StageGraph]:
    """The ONNX model of one row's prefill of `length` positions (T) over a C-position cache
    (`llm_prefill_fused_t<T>`), and its stage spec: the step's layers with a [1, T, D] input and
    no head (the cache is its only output; the prompt's last position is the row's first step's
    input, as FusedDecodeStep.prefill_rows does). `seqlens_k` is the row's length after the T
    positions less one (GroupQueryAttention's subsequent-prompt case: the positions before
    them are the past, in place); a shorter prompt is right-padded, so that its real
    positions never attend to the padding (causal) and the padding's cache lies past the
    row's length, where no step reads it before it writes there."""
    return _build_fused(llm, 1, length, positions)


def _build_fused(llm: Any, batch: int, length: int, positions: int) -> tuple[Any, StageGraph]:
    """A fused step (length 1, with the head) or a fused prefill (batch 1, no head)."""
    require("onnx", "onnx", "exporting the LLM")
    from onnx import TensorProto, helper, numpy_helper

    config = llm.llm.model.config
    if getattr(config, "hidden_act", "silu") != "silu":
        raise CheckpointError(f"fused LLM step: hidden_act {config.hidden_act!r} is not supported (expected silu)")
    dims = llm_dims(llm)
    d, n_l, n_h, n_kv, hd, v = (dims["hidden_size"], dims["num_layers"], dims["num_heads"],
                                dims["num_kv_heads"], dims["head_dim"], dims["speech_vocab_size"])
    if batch < 1 or positions < 2 or not 1 <= length < positions:
        raise CheckpointError(f"fused LLM graph: batch {batch}, length {length} and positions {positions} must be "
                              ">= 1, in 1..positions - 1 and >= 2")
    head_out = length == 1  # a step; a prefill (length > 1, batch 1) writes the cache only
    stage = _fused_stage(dims, batch, length, positions)
    qwen = llm.llm.model.model
    inits: list[Any] = []
    nodes: list[Any] = []

    def init(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    cos, sin = rope_caches(llm, positions)
    init("cos_cache", cos)
    init("sin_cache", sin)
    init("total_sequence_length", np.array(positions, np.int32))  # the longest row: C (an idle row's C - 1 + 1)
    if head_out:
        init("logp_shape", np.array([batch, v], np.int64))

    def norm_eps(norm: Any) -> float:
        return float(norm.variance_epsilon)

    layers = list(qwen.layers)
    first = layers[0].input_layernorm
    nodes.append(helper.make_node("SimplifiedLayerNormalization", ["inputs_embeds", init("ln_in_0", _np(first.weight))],
                                  ["x_0"], name="ln_in_0", axis=-1, epsilon=norm_eps(first), stash_type=1))
    h = "inputs_embeds"
    inputs = [helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, [batch, length, d]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [batch])]
    outputs = [helper.make_tensor_value_info("logp", TensorProto.FLOAT, [batch, v])] if head_out else []
    cache = [batch, n_kv, positions, hd]
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        w_qkv = np.concatenate([_np(attn.q_proj.weight), _np(attn.k_proj.weight), _np(attn.v_proj.weight)]).T
        b_qkv = np.concatenate([_np(p.bias) if p.bias is not None else np.zeros(p.out_features, np.float32)
                                for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
        nodes.append(helper.make_node("MatMul", [f"x_{i}", init(f"w_qkv_{i}", w_qkv)], [f"qkv_mm_{i}"]))
        nodes.append(helper.make_node("Add", [f"qkv_mm_{i}", init(f"b_qkv_{i}", b_qkv)], [f"qkv_{i}"]))
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}_{i}", TensorProto.FLOAT, cache))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}_{i}", TensorProto.FLOAT, cache))
        nodes.append(helper.make_node(
            "GroupQueryAttention",
            [f"qkv_{i}", "", "", f"past_key_{i}", f"past_value_{i}", "seqlens_k", "total_sequence_length",
             "cos_cache", "sin_cache"],
            [f"attn_{i}", f"present_key_{i}", f"present_value_{i}"], name=f"gqa_{i}", domain=MS_DOMAIN,
            num_heads=n_h, kv_num_heads=n_kv, do_rotary=1, rotary_interleaved=0, scale=float(attn.scaling)))
        if not head_out and i == n_l - 1:
            break  # a prefill needs the last layer's K/V, not its output
        nodes.append(helper.make_node("MatMul", [f"attn_{i}", init(f"w_o_{i}", _np(attn.o_proj.weight).T)],
                                      [f"o_{i}"]))
        post = layer.post_attention_layernorm
        nodes.append(helper.make_node(
            "SkipSimplifiedLayerNormalization", [f"o_{i}", h, init(f"ln_post_{i}", _np(post.weight))],
            [f"xm_{i}", "", "", f"h_attn_{i}"], name=f"ln_post_{i}", domain=MS_DOMAIN, epsilon=norm_eps(post)))
        h = f"h_attn_{i}"
        nodes.append(helper.make_node("MatMul", [f"xm_{i}", init(f"w_gate_{i}", _np(mlp.gate_proj.weight).T)],
                                      [f"gate_{i}"]))
        nodes.append(helper.make_node("MatMul", [f"xm_{i}", init(f"w_up_{i}", _np(mlp.up_proj.weight).T)],
                                      [f"up_{i}"]))
        nodes.append(helper.make_node("QuickGelu", [f"gate_{i}"], [f"silu_{i}"], domain=MS_DOMAIN, alpha=1.0))
        nodes.append(helper.make_node("Mul", [f"silu_{i}", f"up_{i}"], [f"act_{i}"]))
        nodes.append(helper.make_node("MatMul", [f"act_{i}", init(f"w_down_{i}", _np(mlp.down_proj.weight).T)],
                                      [f"mlp_{i}"]))
        nxt = layers[i + 1].input_layernorm if i + 1 < n_l else qwen.norm
        out_x = f"x_{i + 1}" if i + 1 < n_l else "x_final"
        out_h = f"h_{i + 1}" if i + 1 < n_l else ""
        nodes.append(helper.make_node(
            "SkipSimplifiedLayerNormalization", [f"mlp_{i}", h, init(f"ln_in_{i + 1}", _np(nxt.weight))],
            [out_x, "", "", out_h], name=f"ln_in_{i + 1}", domain=MS_DOMAIN, epsilon=norm_eps(nxt)))
        h = out_h
    value_info = []
    if head_out:
        head = llm.llm_decoder
        nodes.append(helper.make_node("MatMul", ["x_final", init("w_head", _np(head.weight).T)], ["head_mm"]))
        if head.bias is not None:
            nodes.append(helper.make_node("Add", ["head_mm", init("b_head", _np(head.bias))], ["head_b"]))
        nodes.append(helper.make_node("Reshape", ["head_b" if head.bias is not None else "head_mm", "logp_shape"],
                                      ["logits"]))
        # named: the fp16 variant keeps it in fp32 (exp and a sum over the vocabulary)
        nodes.append(helper.make_node("LogSoftmax", ["logits"], ["logp"], name=LOGP_NODE, axis=-1))
        # the logits' type declared: onnx's shape inference stops at the contrib operators, and the
        # fp16 converter casts a kept-fp32 node's input only where it knows the input is float
        value_info = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, v])]
    graph = helper.make_graph(nodes, stage.name, inputs, outputs, inits, value_info=value_info)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)],
                              producer_name="cosyedge")
    model.ir_version = IR_VERSION

    return model, stage


def _fused_stage(dims: dict[str, int], batch: int, length: int, positions: int) -> StageGraph:
    """The stage spec of a fused step (length 1) or prefill (batch 1)."""
    head_out = length == 1
    cache = (batch, dims["num_kv_heads"], positions, dims["head_dim"])
    kv = [(i, k) for i in range(dims["num_layers"]) for k in ("key", "value")]
    past_spec = [TensorSpec(f"past_{k}_{i}", "float32", cache) for i, k in kv]
    present_spec = [TensorSpec(f"present_{k}_{i}", "float32", cache) for i, k in kv]
    logp_spec = [TensorSpec("logp", "float32", (batch, dims["speech_vocab_size"]))] if head_out else []
    shape_key = {"batch": batch} if head_out else {"length": length}
    name = fused_stage_name(batch) if head_out else fused_prefill_name(length)
    return StageGraph(
        name, f"{name}.onnx",
        [TensorSpec("inputs_embeds", "float32", (batch, length, dims["hidden_size"])),
         TensorSpec("seqlens_k", "int32", (batch,)), *past_spec],
        [*logp_spec, *present_spec],
        {}, extra={**shape_key, "positions": positions, "fused": "onnxruntime",
                   "kv_cache": {"layout": "[L, 2, R, Hkv, C, hd]", "in_place": True, "dtype": "float32"}},
    )


def _resize(model: Any, name: str, batch: int, length: int) -> None:
    """Turn a built (and converted) fused graph, in place, into the one of another batch size (a step) or
    prompt length (a prefill): the same nodes and weights, only the shapes that carry B (every tensor of
    a step leads with it) or T (the prompt's embeddings and their cast), the graph's name and a step's
    `logp_shape` differ from what _build_fused gives (tests/edge_build/export/test_llm_fused_resize.py
    compares the bytes). Building and converting each size anew was most of the fused export's time at
    full size (0.7-1.4 GB a graph)."""
    from onnx import numpy_helper

    g = model.graph
    g.name = name
    embeds = next(v for v in g.input if v.name == "inputs_embeds")
    old = [d.dim_value for d in embeds.type.tensor_type.shape.dim]
    infos = [*g.input, *g.output, *g.value_info]
    if old[1] == 1:  # a step: B
        for info in infos:
            dims = info.type.tensor_type.shape.dim
            if len(dims) and dims[0].dim_value == old[0]:
                dims[0].dim_value = batch
        for t in g.initializer:
            if t.name == "logp_shape":
                vocab = int(numpy_helper.to_array(t)[1])
                t.CopyFrom(numpy_helper.from_array(np.array([batch, vocab], np.int64), "logp_shape"))
    else:  # a prefill: T
        for info in infos:
            dims = info.type.tensor_type.shape.dim
            if [d.dim_value for d in dims] == old:
                dims[1].dim_value = length


def build_kv_insert(dims: dict[str, int], positions: int) -> tuple[Any, StageGraph]:
    """One prompt's cache of a prefill's [L, 2, B, Hkv, T, hd] (the one at `batch_row`
    [1]: a batched prefill's rows, FusedDecodeStep.prefill_rows) as one slot row:
    `row_key_<i>` / `row_value_<i>` [1, Hkv, C, hd], zero after T. The runtime binds them
    to the row's views of the buffer (dynamic B and T: never captured)."""
    from onnx import TensorProto, helper, numpy_helper

    n_l, n_kv, hd = dims["num_layers"], dims["num_kv_heads"], dims["head_dim"]
    inits = [numpy_helper.from_array(np.array([4], np.int64), "axis_t"),
             numpy_helper.from_array(np.array([positions], np.int64), "positions"),
             numpy_helper.from_array(np.zeros(4, np.int64), "pads_head"),
             numpy_helper.from_array(np.zeros(1, np.int64), "zero"),
             numpy_helper.from_array(np.zeros(2, np.int64), "pads_mid")]
    nodes = [helper.make_node("Gather", ["present_kv", INSERT_ROW], ["present_row"], axis=2),  # [L, 2, 1, Hkv, T, hd]
             helper.make_node("Shape", ["present_row"], ["kv_shape"]),
             helper.make_node("Gather", ["kv_shape", "axis_t"], ["t"], axis=0),
             helper.make_node("Sub", ["positions", "t"], ["tail"]),
             # Pad of [1, Hkv, T, hd]: begins 0, ends (0, 0, C - T, 0)
             helper.make_node("Concat", ["pads_head", "pads_mid", "tail", "zero"], ["pads"], axis=0)]
    outputs, out_specs = [], []
    for i in range(n_l):
        inits.append(numpy_helper.from_array(np.array(i, np.int64), f"layer_{i}"))
        nodes.append(helper.make_node("Gather", ["present_row", f"layer_{i}"], [f"kv_{i}"], axis=0))
        for k, kind in enumerate(("key", "value")):
            if i == 0:
                inits.append(numpy_helper.from_array(np.array(k, np.int64), f"kind_{k}"))
            name = f"row_{kind}_{i}"
            nodes.append(helper.make_node("Gather", [f"kv_{i}", f"kind_{k}"], [f"{name}_t"], axis=0))
            nodes.append(helper.make_node("Pad", [f"{name}_t", "pads"], [name]))
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, n_kv, positions, hd]))
            out_specs.append(TensorSpec(name, "float32", (1, n_kv, positions, hd)))
    graph = helper.make_graph(
        nodes, KV_INSERT,
        [helper.make_tensor_value_info("present_kv", TensorProto.FLOAT, [n_l, 2, "B", n_kv, "T", hd]),
         helper.make_tensor_value_info(INSERT_ROW, TensorProto.INT64, [1])],
        outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="cosyedge")
    model.ir_version = IR_VERSION
    stage = StageGraph(KV_INSERT, f"{KV_INSERT}.onnx",
                       [TensorSpec("present_kv", "float32", (n_l, 2, "B", n_kv, "T", hd)),
                        TensorSpec(INSERT_ROW, "int64", (1,))], out_specs,
                       {"B": [1, 4, 16], "T": [1, 128, positions - 1]},
                       extra={"positions": positions, "kv_cache": {"dtype": "float32"}})
    return model, stage


def is_fused_stage(name: str) -> bool:
    """A stage of the fused decode path (a step or prefill graph, or the insert graph)."""
    return has_layer_weights(name) or name == KV_INSERT


def has_layer_weights(name: str) -> bool:
    """A fused step or prefill graph (they hold the layers' weights; the insert graph holds none)."""
    return name.startswith((FUSED_PREFIX, FUSED_PREFILL_PREFIX))


def _cache_io(name: str) -> bool:
    return name.startswith(("past_key_", "past_value_", "present_key_", "present_value_", "row_"))


def convert_fused_fp16(src: Path, dst: Path) -> None:
    """The fp32 fused graph `src` (a step or the insert graph) in fp16 to `dst`:
    edge_build/quantize/fp16.py's policy with the KV cache I/O in fp16 and the
    final LogSoftmax kept fp32 (module docstring). The one conversion both
    `build export --fused-decode-precision fp16` and device_fp16.py use."""
    onnx = require("onnx", "onnx", "converting the fused LLM step")
    from cosyedge_build.quantize.fp16 import convert_fp16

    graph = onnx.load(str(src), load_external_data=False).graph
    cache = [v.name for v in (*graph.input, *graph.output) if _cache_io(v.name)]
    convert_fp16(src, dst, [n.name for n in graph.node if n.name == LOGP_NODE], cache)


def convert_fused_fp16_in_place(path: Path) -> None:
    """convert_fused_fp16 of `path` over itself (through a temporary file beside it)."""
    tmp = path.with_suffix(".fp16.onnx")
    convert_fused_fp16(path, tmp)
    tmp.replace(path)


def fp16_fields(entry: dict[str, Any]) -> dict[str, Any]:
    """A fused stage's manifest fields for its fp16 graph: the cache I/O's
    dtype, `kv_cache.dtype`, `precision` (the rest of the entry is unchanged)."""
    def io(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**s, "dtype": "float16"} if _cache_io(s["name"]) else s for s in specs]

    return {"precision": "fp16", "inputs": io(entry["inputs"]), "outputs": io(entry["outputs"]),
            "kv_cache": {**entry.get("kv_cache", {}), "dtype": KV_DTYPES["fp16"]}}


def _as_fp16(stage: StageGraph) -> StageGraph:
    def specs(items: list[TensorSpec]) -> list[TensorSpec]:
        return [TensorSpec(t.name, "float16", t.shape) if _cache_io(t.name) else t for t in items]

    extra = {**stage.extra, "precision": "fp16", "kv_cache": {**stage.extra["kv_cache"], "dtype": KV_DTYPES["fp16"]}}
    return StageGraph(stage.name, stage.file, specs(stage.inputs), specs(stage.outputs), stage.profile,
                      stage.external_data, extra)


def export_fused_decode(llm: Any, out: Path, batches: list[int] | tuple[int, ...], positions: int,
                        precision: str = "fp32", prefill_lengths: list[int] | tuple[int, ...] = ()) -> list[StageGraph]:
    """llm_decode_fused_b<B>.onnx for each B (weights inline, one copy per file; `build export`
    then moves them into one shared data file, shared_weights.share_stages),
    llm_prefill_fused_t<T>.onnx for each T of `prefill_lengths`, and
    llm_fused_kv_insert.onnx, in `precision` (PRECISIONS). The smallest B and T are built
    (and converted); the other sizes are their graphs resized (_resize)."""
    onnx = require("onnx", "onnx", "exporting the LLM")
    if precision not in PRECISIONS:
        raise CheckpointError(f"fused LLM step: precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    dims = llm_dims(llm)

    def save(model: Any, file: str) -> None:
        onnx.save_model(model, str(Path(out) / file))  # contrib operators: onnx.checker does not know them

    def convert(stage: StageGraph) -> None:
        if precision == "fp16":
            convert_fused_fp16_in_place(Path(out) / stage.file)

    stages = []
    # (batch, length) of each step, then of each prefill
    families = ([(b, 1) for b in sorted(set(batches))], [(1, t) for t in sorted(set(prefill_lengths))])
    for shapes in families:
        if not shapes:
            continue
        model, first = _build_fused(llm, shapes[0][0], shapes[0][1], positions)
        save(model, first.file)
        del model
        convert(first)
        stages.append(first)
        if len(shapes) > 1:
            model = onnx.load(str(Path(out) / first.file))
            for batch, length in shapes[1:]:
                stage = _fused_stage(dims, batch, length, positions)
                _resize(model, stage.name, batch, length)
                save(model, stage.file)
                stages.append(stage)
            del model
    model, stage = build_kv_insert(dims, positions)
    onnx.save_model(model, str(Path(out) / stage.file))
    onnx.checker.check_model(str(Path(out) / stage.file))
    convert(stage)
    stages.append(stage)
    if precision == "fp16":
        stages = [_as_fp16(s) for s in stages]
    for s in stages:
        log.info("exported %s (%s, %.1f MB)", s.file, precision, (Path(out) / s.file).stat().st_size / 1e6)
    return stages
