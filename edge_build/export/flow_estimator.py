"""The CFM estimator stage: one evaluation of upstream's
CausalConditionalDecoder (the U-Net of causal ResNet blocks and transformer
blocks), with our own attention and mask construction so that streaming is
an input (`chunk_frames`) instead of a Python flag."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from edge_build.export.flow_encoder import chunk_allowed
from edge_build.export.graphs import StageGraph, TensorSpec, export_stage, module_base
from edge_build.reference import require
from models.errors import CheckpointError

FRAMES = [2, 300, 1500]  # mel frames: up to 30 s at 50 frames/s, prompt included
BATCH = [2, 2, 8]  # 2 x requests (conditional and unconditional halves)
# upstream's mask_to_bias: masked attention gets this additive bias
_MASK_BIAS = -1.0e10


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


def make_estimator_graph(estimator: Any) -> Any:
    torch = _torch()
    if type(estimator).__name__ != "CausalConditionalDecoder":
        raise CheckpointError(
            f"flow estimator is a {type(estimator).__name__}; expected CausalConditionalDecoder"
        )
    for group in (estimator.down_blocks, estimator.mid_blocks, estimator.up_blocks):
        for blocks in group:
            for block in blocks[1]:
                _check_block(block)
    half = estimator.time_embeddings.dim // 2
    freqs = torch.exp(torch.arange(half).float() * -(math.log(10000) / (half - 1)))

    class EstimatorGraph(module_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.est = estimator
            self.register_buffer("freqs", freqs, persistent=False)

        @staticmethod
        def transformer(block: Any, x: Any, bias: Any) -> Any:
            attn = block.attn1
            b, t = x.shape[0], x.shape[1]
            n = block.norm1(x)
            q, k, v = attn.to_q(n), attn.to_k(n), attn.to_v(n)
            heads = attn.heads
            hd = q.shape[-1] // heads
            q = q.view(b, t, heads, hd).transpose(1, 2)
            k = k.view(b, t, heads, hd).transpose(1, 2)
            v = v.view(b, t, heads, hd).transpose(1, 2)
            scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(hd)) + bias
            ctx = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, t, heads * hd)
            x = attn.to_out[0](ctx) + x
            return block.ff(block.norm3(x)) + x

        def level(self, resnet: Any, blocks: Any, x: Any, mask: Any, temb: Any, chunk: Any) -> Any:
            x = resnet(x, mask, temb).transpose(1, 2)
            t = x.shape[1]
            allowed = (mask > 0) & chunk_allowed(torch, t, chunk)  # [B, T, T]
            bias = ((1.0 - allowed.float()) * _MASK_BIAS).unsqueeze(1)
            for block in blocks:
                x = self.transformer(block, x, bias)
            return x.transpose(1, 2)

        def forward(self, x: Any, mask: Any, mu: Any, t: Any, spks: Any, cond: Any, chunk_frames: Any) -> Any:
            est = self.est
            temb = 1000.0 * t.unsqueeze(1) * self.freqs.unsqueeze(0)
            temb = est.time_mlp(torch.cat((temb.sin(), temb.cos()), dim=-1))
            h = torch.cat((x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond), dim=1)
            hiddens, masks = [], [mask]
            for resnet, blocks, downsample in est.down_blocks:
                m = masks[-1]
                h = self.level(resnet, blocks, h, m, temb, chunk_frames)
                hiddens.append(h)
                h = downsample(h * m)
                masks.append(m[:, :, ::2])
            masks = masks[:-1]
            m = masks[-1]
            for resnet, blocks in est.mid_blocks:
                h = self.level(resnet, blocks, h, m, temb, chunk_frames)
            for resnet, blocks, upsample in est.up_blocks:
                m = masks.pop()
                skip = hiddens.pop()
                h = torch.cat((h[:, :, : skip.shape[-1]], skip), dim=1)
                h = self.level(resnet, blocks, h, m, temb, chunk_frames)
                h = upsample(h * m)
            h = est.final_block(h, m)
            return est.final_proj(h * m) * mask

    return EstimatorGraph().eval()


def export_flow_estimator(flow: Any, out: Path) -> tuple[StageGraph, Path]:
    """flow_estimator.onnx and flow_noise.npy (the CFM's fixed start noise)."""
    torch = _torch()
    decoder = flow.decoder
    c = int(decoder.estimator.out_channels)
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
        ],
        [TensorSpec("dphi_dt", "float32", ("N", c, "T"))],
        {"N": BATCH, "T": FRAMES},
    )
    frames = 37
    mask = torch.ones(2, 1, frames)
    mask[1, :, 30:] = 0
    example = (
        torch.randn(2, c, frames),
        mask,
        torch.randn(2, c, frames),
        torch.rand(2),
        torch.randn(2, c),
        torch.randn(2, c, frames),
        torch.tensor([50, 0]),
    )
    export_stage(make_estimator_graph(decoder.estimator), example, out, stage)
    noise_path = out / "flow_noise.npy"
    np.save(noise_path, decoder.rand_noise[0].detach().float().cpu().numpy().astype(np.float32))
    return stage, noise_path
