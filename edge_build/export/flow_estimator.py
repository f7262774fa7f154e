"""The CFM estimator stage: one evaluation of upstream's
CausalConditionalDecoder (the U-Net of causal ResNet blocks and transformer
blocks), with our own attention and mask construction so that streaming is
an input (`chunk_frames`) instead of a Python flag, and with caches so that a
streaming request evaluates only its new frames.

Why caching is exact: in streaming mode every frame of CosyVoice 2's
estimator sees (a) through attention, the frames of its own static mask
chunk and all earlier frames, (b) through its causal convolutions (kernel 3,
left padding), the two frames before it. Nothing depends on the absolute
position: the transformer blocks carry no positional encoding (matcha's
BasicTransformerBlock: norm, self-attention, norm, feed-forward; the only
sinusoid is the time-step embedding of `t`), the ResNet blocks are per-frame
apart from their convolutions. So once a mask chunk is complete its frames'
hidden states are final, and a later call needs from them only the attention
K/V of every transformer block and the last (kernel - 1) inputs of every
causal convolution.

Graph I/O (per call; offline synthesis is the same graph with S = 0 and
R = 0):

* x, mu, cond [N, C, T], mask [N, 1, T]: the window, i.e. the frames from
  the last committed frame on (a multiple of `chunk_frames`, so the window's
  local chunk mask is the absolute one); spks [N, C], t [N], chunk_frames [N].
* att_cache [S, L, 2, N, H, D]: K (0) and V (1) of the S committed frames for
  each of the L transformer blocks (U-Net order). Time-major so that the
  runtime can keep one growing buffer and pass a prefix of it without a copy.
* conv_cache [K, N, Cmax, 2]: the last two inputs of each of the K causal
  convolutions before the window (zero-padded to the widest input); zeros
  are upstream's causal padding, so an empty history is all zeros.
* commit [R]: only its length is read: the window's first R frames are
  committed (the runtime passes the frames of the complete mask chunks). A
  shape instead of a value so that every output shape follows from input
  shapes (TensorRT then needs no data-dependent shapes).
* dphi_dt [N, C, T]; att_cache_new [R, L, 2, N, H, D] (K/V of the committed
  frames, to append); conv_cache_new [K, N, Cmax, 2] (the inputs just before
  the new commit point).

U-Nets with more than one level (a strided, non-causal Downsample1D: not
CosyVoice 2's) are not chunk-causal; their graph has the same I/O but is
only exact with empty caches, and the manifest says `stream_cache: false`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_build.export.flow_encoder import chunk_allowed
from cosyedge_build.export.graphs import StageGraph, TensorSpec, export_stage, module_base
from cosyedge_build.reference.modules import require
from cosyedge_models.errors import CheckpointError

FRAMES = [2, 300, 1500]  # mel frames per window: up to 30 s at 50 frames/s, prompt included
BATCH = [2, 2, 8]  # 2 x requests (conditional and unconditional halves)
# Two TensorRT profiles: offline calls (any batch, no cache: S = R = 0, so no
# cache buffers) and streaming calls (one request; the window is the new hop
# plus the unfinished mask chunk, the first one the prompt too; S: committed
# frames before it, R: frames it commits).
OFFLINE_PROFILE = {"N": BATCH, "T": FRAMES, "S": [0, 0, 0], "R": [0, 0, 0]}
STREAM_PROFILE = {"N": [2, 2, 2], "T": [2, 100, 1500], "S": [0, 300, 1500], "R": [0, 50, 1500]}
GRAPH_VERSION = 3  # 1: no caches; 2: caches; 3: the same I/O, the cache rearranged once per call
# upstream's mask_to_bias: masked attention gets this additive bias
_MASK_BIAS = -1.0e10
_KERNEL = 3  # upstream's CausalConv1d kernel in CausalBlock1D and the last down/up sample


def _torch() -> Any:
    return require("torch", "torch", "exporting the flow estimator")


def _check_block(block: Any) -> None:
    attn = block.attn1
    unsupported = (
        block.use_ada_layer_norm
        or block.use_ada_layer_norm_zero
        or block.attn2 is not None
        or block.only_cross_attention
        or block._chunk_size is not None
        or attn.spatial_norm is not None
        or attn.group_norm is not None
        or getattr(attn, "norm_q", None) is not None
        or getattr(attn, "norm_k", None) is not None
        or attn.residual_connection
        or attn.rescale_output_factor != 1.0
    )
    if unsupported:
        raise CheckpointError(
            "the flow estimator's transformer blocks use options CosyVoice 2 does not "
            "(ada-norm, cross-attention, q/k norms, residual scaling)"
        )


def _is_causal_conv(module: Any) -> bool:
    return type(module).__name__ == "CausalConv1d"


def causal_convs(estimator: Any) -> list[Any]:
    """The causal convolutions in the order the graph runs them."""
    convs: list[Any] = []

    def resnet(r: Any) -> None:
        convs.extend((r.block1.block[0], r.block2.block[0]))

    for res, _, down in estimator.down_blocks:
        resnet(res)
        if _is_causal_conv(down):
            convs.append(down)
    for res, _ in estimator.mid_blocks:
        resnet(res)
    for res, _, up in estimator.up_blocks:
        resnet(res)
        if _is_causal_conv(up):
            convs.append(up)
    convs.append(estimator.final_block.block[0])
    for conv in convs:
        if not _is_causal_conv(conv) or conv.kernel_size[0] != _KERNEL or conv.dilation[0] != 1:
            raise CheckpointError(f"flow estimator: expected causal convolutions of kernel {_KERNEL}, found {conv}")
    return convs


def transformer_blocks(estimator: Any) -> list[Any]:
    return [b for group in (estimator.down_blocks, estimator.mid_blocks, estimator.up_blocks)
            for level in group for b in level[1]]


def cache_dims(estimator: Any) -> dict[str, Any]:
    """What the runtime needs to size the caches (recorded in the manifest)."""
    blocks = transformer_blocks(estimator)
    convs = causal_convs(estimator)
    attn = blocks[0].attn1
    heads = int(attn.heads)
    return {
        "blocks": len(blocks),
        "heads": heads,
        "head_dim": int(attn.to_k.out_features) // heads,
        "convs": len(convs),
        "conv_channels": max(int(c.in_channels) for c in convs),
        "conv_history": _KERNEL - 1,
        # single-level U-Net (CosyVoice 2): chunk-causal, so the caches are exact
        "stream_cache": len(estimator.down_blocks) == 1,
    }


def _stack(torch: Any, tensors: list[Any]) -> Any:
    """torch.stack(tensors) as Concats of at most 32 inputs: onnxruntime's CUDA
    Concat refuses more during CUDA-graph capture (a 56-block estimator has 56)."""
    groups = [torch.stack(tensors[i: i + 32], dim=0) for i in range(0, len(tensors), 32)]
    return groups[0] if len(groups) == 1 else torch.cat(groups, dim=0)


def make_estimator_graph(estimator: Any) -> Any:
    torch = _torch()
    if type(estimator).__name__ != "CausalConditionalDecoder":
        raise CheckpointError(
            f"flow estimator is a {type(estimator).__name__}; expected CausalConditionalDecoder"
        )
    for block in transformer_blocks(estimator):
        _check_block(block)
    dims = cache_dims(estimator)
    half = estimator.time_embeddings.dim // 2
    freqs = torch.exp(torch.arange(half).float() * -(math.log(10000) / (half - 1)))
    hist = dims["conv_history"]
    cmax = dims["conv_channels"]

    class EstimatorGraph(module_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.est = estimator
            self.register_buffer("freqs", freqs, persistent=False)

        @staticmethod
        def transformer(block: Any, x: Any, bias: Any, k_cache: Any, v_cache: Any) -> tuple[Any, Any, Any]:
            """Returns the block's output and the window's K, V [N, H, T, D]."""
            attn = block.attn1
            b, t = x.shape[0], x.shape[1]
            n = block.norm1(x)
            q, k, v = attn.to_q(n), attn.to_k(n), attn.to_v(n)
            heads = attn.heads
            hd = q.shape[-1] // heads
            q = q.view(b, t, heads, hd).transpose(1, 2)
            k = k.view(b, t, heads, hd).transpose(1, 2)
            v = v.view(b, t, heads, hd).transpose(1, 2)
            keys = torch.cat((k_cache, k), dim=2)
            values = torch.cat((v_cache, v), dim=2)
            scores = torch.matmul(q, keys.transpose(-1, -2)) * (1.0 / math.sqrt(hd)) + bias
            ctx = torch.matmul(torch.softmax(scores, dim=-1), values).transpose(1, 2).reshape(b, t, heads * hd)
            x = attn.to_out[0](ctx) + x
            return block.ff(block.norm3(x)) + x, k, v

        def forward(self, x: Any, mask: Any, mu: Any, t: Any, spks: Any, cond: Any, chunk_frames: Any,
                    att_cache: Any, conv_cache: Any, commit: Any) -> tuple[Any, Any, Any]:
            keep = torch.arange(commit.shape[0])  # window frames whose K/V are committed
            # the conv inputs just before the new commit point: ext[commit : commit + 2]
            return self.core(x, mask, mu, t, spks, cond, chunk_frames, att_cache, conv_cache, keep,
                             keep.shape[0] + torch.arange(hist), None)

        def core(self, x: Any, mask: Any, mu: Any, t: Any, spks: Any, cond: Any, chunk_frames: Any,
                 att_cache: Any, conv_cache: Any, keep: Any, last: Any, cache_valid: Any) -> tuple[Any, Any, Any]:
            """keep: window frames whose K/V are returned (None: all of them, without a
            Gather per block); last: the conv-input
            frames that become the next history; cache_valid [S] (None: every
            cached frame is visible): 1 for the cached frames to attend to (the
            fixed-size graphs of flow_static.py)."""
            est = self.est
            conv_in: list[Any] = []  # per causal conv: its cache-extended input

            def conv(module: Any, h: Any) -> Any:
                # Feed [history, window]; the module pads 2 more zeros on the left,
                # whose 2 outputs are dropped: the rest is the conv over the true history.
                i = len(conv_in)
                ext = torch.cat((conv_cache[i, :, : h.shape[1], :], h), dim=2)
                conv_in.append(ext)
                return module(ext)[:, :, hist:]

            def causal_block(block: Any, h: Any, m: Any) -> Any:
                layers = list(block.block)
                y = conv(layers[0], h * m)
                for layer in layers[1:]:
                    y = layer(y)
                return y * m

            def resnet(r: Any, h: Any, m: Any, temb: Any) -> Any:
                y = causal_block(r.block1, h, m) + r.mlp(temb).unsqueeze(-1)
                y = causal_block(r.block2, y, m)
                return y + r.res_conv(h * m)

            new_kv: list[Any] = []
            block_index = [0]
            # The time-major cache [S, L, 2, N, H, D] rearranged once per call to
            # [L * 2, N, H, S, D]: each block's K and V are then contiguous slabs
            # (onnxruntime cuts them with one fast Split), instead of strided
            # slices (which onnxruntime fused into one slow Split of the whole
            # cache) and a transpose per block. The concatenation with the
            # window stays: attending to the cache in a separate part avoids it
            # but copies the score matrix instead, which is worse offline. (Reshaped while S leads:
            # in ONNX a 0 in a shape copies the input's dimension, so with no
            # cache, S = 0 must stay where it is.)
            frames, blocks_, kv, rows, heads_, head_dim = att_cache.shape
            if cache_valid is not None:
                # rows past the valid ones hold whatever the buffer held (uninitialized
                # memory can be inf or NaN, which an additive mask does not remove)
                att_cache = torch.where(cache_valid.view(-1, 1, 1, 1, 1, 1) > 0, att_cache, 0.0)
            kv_cache = att_cache.reshape(frames, blocks_ * kv, rows, heads_, head_dim).permute(1, 2, 3, 0, 4)

            def level(r: Any, blocks: Any, h: Any, m: Any, temb: Any) -> Any:
                h = resnet(r, h, m, temb).transpose(1, 2)
                tw = h.shape[1]
                allowed = (m > 0) & chunk_allowed(torch, tw, chunk_frames)  # [N, T, T]
                bias = ((1.0 - allowed.float()) * _MASK_BIAS).unsqueeze(1)
                # committed frames precede the window's chunks: always visible
                if cache_valid is None:
                    cached = torch.zeros(bias.shape[0], 1, tw, att_cache.shape[0], dtype=bias.dtype)
                else:  # a fixed-size cache: only its valid rows are visible
                    cached = ((1.0 - cache_valid) * _MASK_BIAS).view(1, 1, 1, -1).expand(bias.shape[0], 1, tw, -1)
                bias = torch.cat((cached, bias), dim=-1)
                for block in blocks:
                    j = block_index[0]
                    block_index[0] += 1
                    k_cache, v_cache = kv_cache[2 * j], kv_cache[2 * j + 1]
                    h, k, v = self.transformer(block, h, bias, k_cache, v_cache)
                    if keep is not None:
                        k, v = k.index_select(2, keep), v.index_select(2, keep)
                    new_kv.append(torch.stack((k, v), dim=0))
                return h.transpose(1, 2)

            def sample(module: Any, h: Any) -> Any:
                return conv(module, h) if _is_causal_conv(module) else module(h)

            temb = 1000.0 * t.unsqueeze(1) * self.freqs.unsqueeze(0)
            temb = est.time_mlp(torch.cat((temb.sin(), temb.cos()), dim=-1))
            h = torch.cat((x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond), dim=1)
            hiddens, masks = [], [mask]
            for r, blocks, downsample in est.down_blocks:
                m = masks[-1]
                h = level(r, blocks, h, m, temb)
                hiddens.append(h)
                h = sample(downsample, h * m)
                masks.append(m[:, :, ::2])
            masks = masks[:-1]
            m = masks[-1]
            for r, blocks in est.mid_blocks:
                h = level(r, blocks, h, m, temb)
            for r, blocks, upsample in est.up_blocks:
                m = masks.pop()
                skip = hiddens.pop()
                h = torch.cat((h[:, :, : skip.shape[-1]], skip), dim=1)
                h = level(r, blocks, h, m, temb)
                h = sample(upsample, h * m)
            h = causal_block(est.final_block, h, m)
            out = est.final_proj(h * m) * mask
            # [L, 2, N, H, R, D] -> time-major [R, L, 2, N, H, D]
            att_new = _stack(torch, new_kv).permute(4, 0, 1, 2, 3, 5)
            conv_new = [
                torch.nn.functional.pad(ext.index_select(2, last), (0, 0, 0, cmax - ext.shape[1]))
                for ext in conv_in
            ]
            return out, att_new, _stack(torch, conv_new)

    return EstimatorGraph().eval()


def empty_caches(torch: Any, dims: dict[str, Any], batch: int) -> tuple[Any, Any, Any]:
    """att_cache, conv_cache and commit of an offline call (no history)."""
    att = torch.zeros(0, dims["blocks"], 2, batch, dims["heads"], dims["head_dim"])
    conv = torch.zeros(dims["convs"], batch, dims["conv_channels"], dims["conv_history"])
    return att, conv, torch.zeros(0)


def export_flow_estimator(flow: Any, out: Path) -> tuple[StageGraph, Path]:
    """flow_estimator.onnx and flow_noise.npy (the CFM's fixed start noise)."""
    torch = _torch()
    decoder = flow.decoder
    c = int(decoder.estimator.out_channels)
    dims = cache_dims(decoder.estimator)
    shape_kv = ("S", dims["blocks"], 2, "N", dims["heads"], dims["head_dim"])
    shape_conv = (dims["convs"], "N", dims["conv_channels"], dims["conv_history"])
    stage = StageGraph(
        "flow_estimator",
        "flow_estimator.onnx",
        [
            TensorSpec("x", "float32", ("N", c, "T")),
            TensorSpec("mask", "float32", ("N", 1, "T")),
            TensorSpec("mu", "float32", ("N", c, "T")),
            TensorSpec("t", "float32", ("N",)),
            TensorSpec("spks", "float32", ("N", c)),
            TensorSpec("cond", "float32", ("N", c, "T")),
            TensorSpec("chunk_frames", "int64", ("N",)),
            TensorSpec("att_cache", "float32", shape_kv),
            TensorSpec("conv_cache", "float32", shape_conv),
            TensorSpec("commit", "float32", ("R",)),
        ],
        [
            TensorSpec("dphi_dt", "float32", ("N", c, "T")),
            TensorSpec("att_cache_new", "float32", ("R", *shape_kv[1:])),
            TensorSpec("conv_cache_new", "float32", shape_conv),
        ],
        [OFFLINE_PROFILE, STREAM_PROFILE],
        extra={"graph_version": GRAPH_VERSION, "cache": dims},
    )
    # Trace with a non-empty cache and commit so that no size folds to a constant.
    frames, past = 37, 5
    mask = torch.ones(2, 1, frames)
    mask[1, :, 30:] = 0
    att, conv, _ = empty_caches(torch, dims, 2)
    example = (
        torch.randn(2, c, frames),
        mask,
        torch.randn(2, c, frames),
        torch.rand(2),
        torch.randn(2, c),
        torch.randn(2, c, frames),
        torch.tensor([50, 0]),
        torch.randn(past, *att.shape[1:]),
        torch.randn(*conv.shape),
        torch.zeros(3),
    )
    export_stage(make_estimator_graph(decoder.estimator), example, out, stage)
    noise_path = out / "flow_noise.npy"
    np.save(noise_path, decoder.rand_noise[0].detach().float().cpu().numpy().astype(np.float32))
    return stage, noise_path
