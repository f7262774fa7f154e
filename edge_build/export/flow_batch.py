"""Fixed-shape flow estimator windows batched across streams
(`flow_estimator_batch_b<B>_w<W>`, one graph per batch size B and window W;
`build export --batch-flow-sizes`), beside the single-stream graphs of
flow_static.py, which stay as they are.

A call serves B streams: its N = 2B rows are the streams' guidance pairs
(row 2b conditional, 2b + 1 unconditional, as the single-stream graph's two
rows), each stream with its own cache length. The K/V cache is kept in
attention layout, one tensor per transformer block and K|V, `[N, H, F, D]`
(F = cache_frames + the largest window, see below), and is written in
place: the graph scatters the window's K/V (every window frame) into each
row at the row's length (ScatterND) and attends over the whole buffer with a
per-row additive mask; the runtime binds `key_cache_<i>` and
`key_cache_out_<i>` (and the values) to the SAME memory, a view of one
buffer `[L, 2, R, H, F, D]` (rows 0..N-1), so nothing of the cache is
masked, permuted, split or concatenated per call (the single-stream graph
does all four). Frames at or past a row's length are free: the window's
uncommitted frames written there are simply overwritten by the next call,
and an idle row of a padded batch (length: its own) writes only there too.
That is why F has the largest window's frames beyond `cache_frames`: a row
holds at most `cache_frames` committed frames and any window still fits.

Inputs (N = 2B rows, B streams, C channels, W window frames):
* x, mu, cond [N, C, W], mask [N, 1, W], t [N], spks [N, C]: as the
  single-stream graph (shorter windows right-padded with mask 0).
* cache_first, cache_len, commit [B] int64: per stream, the first visible
  cached frame (bounded left context), the committed frames held, and how
  many of the window's first frames this call commits (0: the conv history
  is kept as it is).
* key_cache_<i>, value_cache_<i> [N, H, F, D] for the L blocks (U-Net order).
* conv_cache [N, K, Cmax, 2]: the K causal convolutions' history, rows first
  (so that rows 0..N-1 of the runtime's buffer are one contiguous view).
Outputs: dphi_dt [N, C, W]; key_cache_out_<i>, value_cache_out_<i> (the
same buffers, bound in place); conv_cache_new [N, K, Cmax, 2] (per row the
inputs just before its new commit point: its history as it was where it
commits nothing; channels past a convolution's own are zero), which the
runtime copies over conv_cache.

Attention (`build export --batch-flow-attention`, ATTENTIONS): `plain` writes it in standard
operators (MatMul, Softmax, the head transposes), which any runtime reads; `fused` writes each
block's attention as one `com.microsoft` MultiHeadAttention (onnxruntime's contrib operator: query
[N, W, H*D] as projected, key and value the buffers in [N, H, F, D], the mask as its attention bias)
and scatters the window's K/V from the projection's [N, W, H, D] order, so the graph has no head
transposes and no score tensors of its own; each projection's bias, the residual and the next
LayerNorm are one SkipLayerNormalization, the feed-forward's bias and GELU one BiasGelu
(flow_batch_ops.py), and its K/V buffers are declared [N, H, F, D / KV_PART, KV_PART] (below):
fewer and shorter kernels a replay on a launch-bound GPU. Only onnxruntime runs it (TensorRT cannot
parse contrib operators; the batched graphs are onnxruntime's anyway). Both variants run each
causal convolution on its history and window without a pad of its own, and every resnet's time
projection as one Gemm."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from cosyedge_build.export.flow_batch_ops import fusable, fused_functions
from cosyedge_build.export.flow_encoder import chunk_allowed
from cosyedge_build.export.flow_estimator import (
    _check_block,
    _is_causal_conv,
    _stack,
    _torch,
    cache_dims,
    transformer_blocks,
)
from cosyedge_build.export.graphs import StageGraph, TensorSpec, export_stage, module_base
from cosyedge_build.reference.modules import require
from cosyedge_models.bundle.loader import BATCH_FLOW_PREFIX
from cosyedge_models.errors import CheckpointError

CFG_ROWS = 2  # guidance pair per stream
PRECISIONS = ("fp32", "fp16")
ATTENTIONS = ("plain", "fused")
# The additive bias of a hidden frame. Not the single-stream graph's -1e10: in the fp16 variant
# that constant is clipped to -65504, a negative score plus it overflows to -inf, and an idle lane
# (every frame hidden) can then get softmax(-inf, ...) = NaN, which it writes as K/V into its free
# frames (where an additive mask cannot hide it from the lane's next stream). -3e4 stays finite in
# fp16 with any score below 3.5e4 in magnitude, and exp(-3e4) is 0 in fp32 as in fp16: the same
# softmax wherever a frame is visible.
MASK_BIAS = -3.0e4


# The fused graphs declare each K/V buffer [N, H, F, D / KV_PART, KV_PART] (the same memory as [N, H, F, D]) and
# scatter the window into it by (row, head, frame, part): onnxruntime's CUDA ScatterND gives each index one
# thread that copies the index's slice value after value, and with a head's 64 values a slice the 112 writes
# of a full-size replay were ~46 % of its GPU time on the H200 (fourteenth run; 8 values a slice: ~11 us a
# write at 16 streams against ~31, device_scatter_bench.py). Declared so, not reshaped inside the graph: a
# Reshape between the bound buffer and the ScatterND makes onnxruntime copy the whole buffer (measured).
KV_PART = 8


def kv_part(head_dim: int, attention: str) -> int:
    """Values a K/V write's slice holds: KV_PART (or the largest common divisor with the head size) in
    the fused graphs, the whole head in the plain ones (their buffers 4-D)."""
    return math.gcd(head_dim, KV_PART) if attention == "fused" else head_dim


def check_options(precision: str, attention: str) -> None:
    """The batched graphs' precision and attention, refused before any export work."""
    if precision not in PRECISIONS:
        raise ValueError(f"batched flow graphs: precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if attention not in ATTENTIONS:
        raise ValueError(f"batched flow graphs: attention {attention!r} is not one of {', '.join(ATTENTIONS)}")


def batch_stage_name(batch: int, window: int) -> str:
    return f"{BATCH_FLOW_PREFIX}{batch}_w{window}"


def buffer_frames(cache_frames: int, windows: list[int]) -> int:
    """F: committed frames plus room for the largest window past them."""
    return cache_frames + max(windows)


def make_batch_graph(estimator: Any, chunk_frames: int, attention: str = "plain") -> Any:
    torch = _torch()
    fused = fused_functions(torch) if attention == "fused" else None  # (export_batch_estimators checks it)
    if type(estimator).__name__ != "CausalConditionalDecoder":
        raise CheckpointError(f"flow estimator is a {type(estimator).__name__}; expected CausalConditionalDecoder")
    blocks_all = transformer_blocks(estimator)
    for block in blocks_all:
        _check_block(block)
    if fused is not None and not all(fusable(block) for block in blocks_all):
        raise CheckpointError("the fused batched graphs need CosyVoice 2's transformer blocks (affine LayerNorms, "
                              "biased output projections, an exact-GELU feed-forward); export them plain")
    dims = cache_dims(estimator)
    if not dims["stream_cache"]:
        raise ValueError("batched estimator graphs need a chunk-causal estimator (single-level U-Net)")
    half = estimator.time_embeddings.dim // 2
    freqs = torch.exp(torch.arange(half).float() * -(math.log(10000) / (half - 1)))
    hist, cmax = dims["conv_history"], dims["conv_channels"]

    class BatchEstimatorGraph(module_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.est = estimator
            self.register_buffer("freqs", freqs, persistent=False)

        def forward(self, x: Any, mask: Any, mu: Any, t: Any, spks: Any, cond: Any, cache_first: Any,
                    cache_len: Any, commit: Any, conv_cache: Any, *kv: Any) -> tuple[Any, ...]:
            est = self.est
            n, w = x.shape[0], x.shape[2]
            frames = kv[0].shape[2]
            # per stream -> per row (the guidance pair shares the stream's cache length)
            first = cache_first.repeat_interleave(CFG_ROWS)
            length = cache_len.repeat_interleave(CFG_ROWS)
            commits = commit.repeat_interleave(CFG_ROWS)
            pos = torch.arange(frames)
            rel = pos.view(1, -1) - length.view(-1, 1)  # [N, F]: buffer frame - row length
            # window positions of the buffer frames (clamped where not a window frame)
            rel_w = torch.clamp(rel, 0, w - 1)
            write_at = length.view(-1, 1, 1) + torch.arange(w).view(1, 1, -1)  # [N, 1, W]
            rows_idx = torch.arange(n).view(-1, 1, 1)
            # fused: the window's K/V positions [N, W, H, D/P, 4] (row, head, frame, part), once for every block
            part = kv_part(dims["head_dim"], attention)
            kv_index = None if fused is None else torch.stack(torch.broadcast_tensors(
                rows_idx.view(-1, 1, 1, 1), torch.arange(dims["heads"]).view(1, 1, -1, 1),
                write_at.transpose(1, 2).unsqueeze(-1), torch.arange(dims["head_dim"] // part).view(1, 1, 1, -1)),
                dim=-1)
            conv_in: list[Any] = []

            def conv(module: Any, h: Any) -> Any:
                i = len(conv_in)
                ext = torch.cat((conv_cache[:, i, : h.shape[1], :], h), dim=2)
                conv_in.append(ext)
                # the history is the causal padding: the convolution without its own zero pad gives the
                # window's frames exactly (CausalConv1d's forward would pad and need a slice after)
                return torch.nn.functional.conv1d(ext, module.weight, module.bias, module.stride, 0, module.dilation,
                                                  module.groups)

            def causal_block(block: Any, h: Any, m: Any) -> Any:
                layers = list(block.block)
                y = conv(layers[0], h * m)
                for layer in layers[1:]:
                    y = layer(y)
                return y * m

            def resnet(r: Any, h: Any, m: Any, temb: Any) -> Any:
                y = causal_block(r.block1, h, m) + temb[id(r)].unsqueeze(-1)
                y = causal_block(r.block2, y, m)
                return y + r.res_conv(h * m)

            def attn_bias(m: Any) -> Any:
                """[N, 1, W, F]: the row's visible cached frames, then its window's frames as the
                single-stream graph sees them (chunk mask over the window, padded keys hidden)."""
                chunk = torch.full((n,), chunk_frames, dtype=torch.int64)
                allowed = (m > 0) & chunk_allowed(torch, w, chunk)  # [N, W(query), W(key)]
                idx = rel_w.view(n, 1, frames).expand(n, w, frames)
                in_window = torch.gather(allowed, 2, idx) & ((rel >= 0) & (rel < w)).view(n, 1, frames)
                cached = ((pos.view(1, -1) >= first.view(-1, 1)) & (rel < 0)).view(n, 1, frames)
                visible = in_window | cached
                return ((1.0 - visible.float()) * MASK_BIAS).unsqueeze(1)

            out_kv: list[Any] = []

            def transformer(block: Any, x_: Any, bias: Any, k_cache: Any, v_cache: Any) -> Any:
                attn = block.attn1
                b, tw = x_.shape[0], x_.shape[1]
                nrm = block.norm1(x_)
                q, k, v = attn.to_q(nrm), attn.to_k(nrm), attn.to_v(nrm)
                heads = attn.heads
                hd = q.shape[-1] // heads
                q = q.view(b, tw, heads, hd).transpose(1, 2)
                k = k.view(b, tw, heads, hd).transpose(1, 2)  # [N, H, W, D]
                v = v.view(b, tw, heads, hd).transpose(1, 2)
                heads_idx = torch.arange(heads).view(1, -1, 1)
                # the window's K/V into the buffer at the row's length (ScatterND, in place)
                keys = k_cache.index_put((rows_idx, heads_idx, write_at), k)
                values = v_cache.index_put((rows_idx, heads_idx, write_at), v)
                out_kv.extend((keys, values))
                scores = torch.matmul(q, keys.transpose(-1, -2)) * (1.0 / math.sqrt(hd)) + bias
                ctx = torch.matmul(torch.softmax(scores, dim=-1), values).transpose(1, 2).reshape(b, tw, heads * hd)
                x_ = attn.to_out[0](ctx) + x_
                return block.ff(block.norm3(x_)) + x_

            def fused_blocks(blocks: Any, x_: Any, bias: Any) -> Any:
                """A level's blocks in onnxruntime's operators: each attention one MultiHeadAttention over
                the buffers (the window's K/V scattered in from the projection's [N, W, H, D] order: no
                transposes), each output projection's bias with the residual and the LayerNorm after it
                one SkipLayerNormalization (attention -> norm3, feed-forward -> the next block's norm1;
                the level's last feed-forward adds its bias and residual as before)."""
                assert fused is not None  # (level calls it for the fused graphs only)
                mha, scatter, bias_gelu, skip_norm = fused
                b, tw = x_.shape[0], x_.shape[1]
                pending = None  # the last block's feed-forward output before its bias, and the bias
                for block in blocks:
                    attn, n1, n3 = block.attn1, block.norm1, block.norm3
                    if pending is None:
                        nrm = n1(x_)
                    else:
                        nrm, x_ = skip_norm.apply(pending[0], x_, n1.weight, n1.bias, pending[1], n1.eps)
                    q, k, v = attn.to_q(nrm), attn.to_k(nrm), attn.to_v(nrm)
                    heads = attn.heads
                    hd = q.shape[-1] // heads
                    j = len(out_kv) // 2
                    keys = scatter.apply(kv[2 * j], kv_index, k.view(b, tw, heads, hd // part, part))
                    values = scatter.apply(kv[2 * j + 1], kv_index, v.view(b, tw, heads, hd // part, part))
                    out_kv.extend((keys, values))
                    out = attn.to_out[0]
                    whole = (b, heads, keys.shape[2], hd)  # the buffers as attention reads them (a view)
                    ctx = torch.matmul(mha.apply(q, keys.view(whole), values.view(whole), bias, heads), out.weight.t())
                    h, x_ = skip_norm.apply(ctx, x_, n3.weight, n3.bias, out.bias, n3.eps)
                    proj, last = block.ff.net[0].proj, block.ff.net[-1]
                    h = bias_gelu.apply(torch.matmul(h, proj.weight.t()), proj.bias)
                    pending = (torch.matmul(h, last.weight.t()), last.bias)
                return x_ if pending is None else pending[0] + pending[1] + x_

            def level(r: Any, blocks: Any, h: Any, m: Any, temb: Any) -> Any:
                h = resnet(r, h, m, temb).transpose(1, 2)
                bias = attn_bias(m)
                if fused is not None:
                    return fused_blocks(blocks, h, bias).transpose(1, 2)
                for block in blocks:
                    j = len(out_kv) // 2
                    h = transformer(block, h, bias, kv[2 * j], kv[2 * j + 1])
                return h.transpose(1, 2)

            def sample(module: Any, h: Any) -> Any:
                return conv(module, h) if _is_causal_conv(module) else module(h)

            temb = 1000.0 * t.unsqueeze(1) * self.freqs.unsqueeze(0)
            temb = est.time_mlp(torch.cat((temb.sin(), temb.cos()), dim=-1))
            # every resnet's time projection (Mish, Linear) of the one time embedding as one Gemm and a Split,
            # not a Gemm (and its bias broadcast) a resnet: their Mish is the same, their weights stacked
            resnets = [level_[0] for level_ in (*est.down_blocks, *est.mid_blocks, *est.up_blocks)]
            weight = torch.cat([r.mlp[1].weight for r in resnets], dim=0)
            bias_ = torch.cat([r.mlp[1].bias for r in resnets], dim=0)
            parts = torch.split(torch.nn.functional.linear(resnets[0].mlp[0](temb), weight, bias_),
                                [int(r.mlp[1].out_features) for r in resnets], dim=1)
            temb = {id(r): part for r, part in zip(resnets, parts, strict=True)}
            h = torch.cat((x, mu, spks.unsqueeze(-1).expand(-1, -1, w), cond), dim=1)
            m = mask
            for r, blocks, downsample in est.down_blocks:  # one level (stream_cache)
                h = level(r, blocks, h, m, temb)
                skip = h
                h = sample(downsample, h * m)
            for r, blocks in est.mid_blocks:
                h = level(r, blocks, h, m, temb)
            for r, blocks, upsample in est.up_blocks:
                h = torch.cat((h[:, :, : skip.shape[-1]], skip), dim=1)
                h = level(r, blocks, h, m, temb)
                h = sample(upsample, h * m)
            h = causal_block(est.final_block, h, m)
            out = est.final_proj(h * m) * mask
            # per row: the conv inputs just before its new commit point, ext[commit : commit + hist]; a row
            # that commits nothing picks ext[0 : hist], its history as it was (no select needed)
            last = (commits.view(-1, 1, 1) + torch.arange(hist).view(1, 1, -1))  # [N, 1, hist]
            conv_new = []
            picks: dict[int, Any] = {}  # the gather index by channel count: one Expand each, not one a conv
            for ext in conv_in:
                index = picks.setdefault(int(ext.shape[1]), last.expand(-1, ext.shape[1], -1))
                picked = torch.gather(ext, 2, index)
                if ext.shape[1] < cmax:
                    picked = torch.nn.functional.pad(picked, (0, 0, 0, cmax - ext.shape[1]))
                conv_new.append(picked)
            return (out, *out_kv, _stack(torch, conv_new).transpose(0, 1))

    return BatchEstimatorGraph().eval()


def kv_names(blocks: int) -> tuple[list[str], list[str]]:
    """Input and output names of the per-block K/V buffers, in graph order."""
    ins = [f"{kind}_cache_{i}" for i in range(blocks) for kind in ("key", "value")]
    return ins, [f"{kind}_cache_out_{i}" for i in range(blocks) for kind in ("key", "value")]


def is_kv_io(name: str) -> bool:
    """A K/V buffer input or output (fp16 in the fp16 variant)."""
    return name.startswith(("key_cache_", "value_cache_"))


def convert_batch_fp16(src: Path, dst: Path) -> None:
    """The fp32 batched estimator graph `src` in fp16 to `dst`: edge_build/quantize/fp16.py's
    policy (the flow unit's time embedding kept fp32, as the single-stream graphs' conversion keeps
    it) with the K/V buffers' I/O in fp16 (the lanes: half the device memory and bytes read per
    replay); the other inputs and outputs stay fp32, so the runtime feeds them as before."""
    onnx = require("onnx", "onnx", "converting the batched estimator graphs")
    from cosyedge_build.quantize.companions import always_fp32_nodes, unit_of
    from cosyedge_build.quantize.fp16 import convert_fp16

    graph = onnx.load(str(src), load_external_data=False).graph
    kv = [v.name for v in (*graph.input, *graph.output) if is_kv_io(v.name)]
    convert_fp16(src, dst, always_fp32_nodes(unit_of("flow_estimator"), src), kv)


def write_fp16(src: Path, dst: Path, old_data: Path | None) -> str | None:
    """`dst` (a new file, also in place of a link or of `src` itself) as the fp16 conversion of the fp32
    batched graph `src`; `old_data`, the fp32 graph's external data there, removed. The name of the
    fp16 graph's own external data file beside it (the name the graph refers to), or None."""
    tmp = dst.with_suffix(".fp16.onnx")
    convert_batch_fp16(src, tmp)
    tmp.replace(dst)
    if old_data is not None:
        old_data.unlink()
    data = dst.parent / (tmp.name + ".data")
    return data.name if data.is_file() else None


def _to_fp16(out: Path, stage: StageGraph) -> StageGraph:
    """The exported fp32 graph of `stage` replaced by its fp16 conversion, and its entry."""
    path = Path(out) / stage.file
    data = write_fp16(path, path, Path(out) / stage.external_data if stage.external_data else None)

    def specs(items: list[TensorSpec]) -> list[TensorSpec]:
        return [TensorSpec(t.name, "float16", t.shape) if is_kv_io(t.name) else t for t in items]

    return StageGraph(stage.name, stage.file, specs(stage.inputs), specs(stage.outputs), stage.profile, data,
                      {**stage.extra, "precision": "fp16"})


def export_batch_estimators(flow: Any, out: Path, batches: list[int], windows: list[int], cache_frames: int,
                            chunk_frames: int, precision: str = "fp32", attention: str = "plain") -> list[StageGraph]:
    """One graph per (batch size, window) over buffers of buffer_frames() frames, in `precision`
    (PRECISIONS; fp16: convert_batch_fp16), its attention `attention` (ATTENTIONS)."""
    check_options(precision, attention)
    torch = _torch()
    estimator = flow.decoder.estimator
    c = int(estimator.out_channels)
    dims = cache_dims(estimator)
    if not dims["stream_cache"]:
        raise ValueError("batched estimator graphs need a chunk-causal estimator (single-level U-Net)")
    if cache_frames < 1 or any(w < 1 for w in windows) or any(b < 1 for b in batches) or not windows:
        raise ValueError(f"batched flow graphs: batch sizes {batches}, windows {windows} and cache "
                         f"{cache_frames} must be >= 1")
    frames = buffer_frames(cache_frames, windows)
    heads, hd, blocks = dims["heads"], dims["head_dim"], dims["blocks"]
    graph = make_batch_graph(estimator, chunk_frames, attention)
    kv_in, kv_out = kv_names(blocks)
    stages = []
    for b in sorted(set(batches)):
        n = CFG_ROWS * b
        conv = (n, dims["convs"], dims["conv_channels"], dims["conv_history"])
        part = kv_part(hd, attention)
        kv_shape = (n, heads, frames, hd // part, part) if attention == "fused" else (n, heads, frames, hd)
        for w in sorted(set(windows)):
            stage = StageGraph(
                batch_stage_name(b, w), f"{batch_stage_name(b, w)}.onnx",
                [
                    TensorSpec("x", "float32", (n, c, w)),
                    TensorSpec("mask", "float32", (n, 1, w)),
                    TensorSpec("mu", "float32", (n, c, w)),
                    TensorSpec("t", "float32", (n,)),
                    TensorSpec("spks", "float32", (n, c)),
                    TensorSpec("cond", "float32", (n, c, w)),
                    TensorSpec("cache_first", "int64", (b,)),
                    TensorSpec("cache_len", "int64", (b,)),
                    TensorSpec("commit", "int64", (b,)),
                    TensorSpec("conv_cache", "float32", conv),
                    *(TensorSpec(name, "float32", kv_shape) for name in kv_in),
                ],
                [
                    TensorSpec("dphi_dt", "float32", (n, c, w)),
                    *(TensorSpec(name, "float32", kv_shape) for name in kv_out),
                    TensorSpec("conv_cache_new", "float32", conv),
                ],
                {},
                extra={"batch": b, "window": w, "cache_frames": cache_frames, "buffer_frames": frames,
                       "chunk_frames": chunk_frames, "cache": dims, "kv_layout": "[L, 2, rows, H, F, D]",
                       "kv_part": part,
                       "attention": attention},
            )
            mask = torch.ones(n, 1, w)
            mask[:, :, w - w // 4:] = 0  # traced with padding, so nothing folds to "all valid"
            lens = torch.arange(b, dtype=torch.int64) % max(1, cache_frames // 2) + 1
            example = (torch.randn(n, c, w), mask, torch.randn(n, c, w), torch.rand(n), torch.randn(n, c),
                       torch.randn(n, c, w), torch.zeros(b, dtype=torch.int64), lens,
                       torch.full((b,), max(1, w // 2), dtype=torch.int64), torch.randn(*conv),
                       *(torch.randn(*kv_shape) for _ in kv_in))
            stages.append(export_stage(graph, example, out, stage))
    if precision == "fp16":
        stages = [_to_fp16(out, s) for s in stages]
    return stages
