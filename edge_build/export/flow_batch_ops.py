"""The fused batched estimator graphs' operators (flow_batch.py, `--batch-flow-attention fused`): torch
autograd Functions that compute their value in torch (what the trace sees) and export as one
onnxruntime operator each, and which transformer blocks they fit."""

from __future__ import annotations

import math
from typing import Any

from cosyedge_build.export.flow_estimator import _torch


def fused_functions(torch: Any) -> Any:
    """The fused graphs' autograd Functions: each computes its value in torch (what the trace sees)
    and exports as one onnxruntime operator: attention over the buffers (com.microsoft
    MultiHeadAttention), the K/V scatter (ScatterND over a shared index), the feed-forward's bias and
    GELU (com.microsoft BiasGelu), an output projection's bias with the residual and the LayerNorm after
    it (com.microsoft SkipLayerNormalization)."""

    class MultiHeadAttention(torch.autograd.Function):  # type: ignore[misc]
        @staticmethod
        def forward(ctx: Any, q: Any, keys: Any, values: Any, bias: Any, heads: int) -> Any:
            n, w = q.shape[0], q.shape[1]
            hd = keys.shape[-1]
            qh = q.view(n, w, heads, hd).transpose(1, 2)
            scores = torch.matmul(qh, keys.transpose(-1, -2)) * (1.0 / math.sqrt(hd)) + bias
            return torch.matmul(torch.softmax(scores, dim=-1), values).transpose(1, 2).reshape(n, w, heads * hd)

        @staticmethod
        def symbolic(g: Any, q: Any, keys: Any, values: Any, bias: Any, heads: int) -> Any:
            absent = g.op("prim::Constant")  # an optional input left out: "" in the ONNX node
            absent.setType(torch._C.OptionalType.ofTensor())
            # inputs: query, key, value, bias (of the projections: none), key_padding_mask, attention_bias
            out = g.op("com.microsoft::MultiHeadAttention", q, keys, values, absent, absent, bias,
                       num_heads_i=heads)
            out.setType(q.type())
            return out

    class ScatterRows(torch.autograd.Function):  # type: ignore[misc]
        """data with `updates` written at `indices` [..., 4] (row, head, frame, part; index_put), exported as
        one ScatterND over an index tensor the graph computes once for every block (index_put builds its
        own each time)."""

        @staticmethod
        def forward(ctx: Any, data: Any, indices: Any, updates: Any) -> Any:
            return data.index_put(tuple(indices[..., i] for i in range(indices.shape[-1])), updates)

        @staticmethod
        def symbolic(g: Any, data: Any, indices: Any, updates: Any) -> Any:
            out = g.op("ScatterND", data, indices, updates)
            out.setType(data.type())
            return out

    class BiasGelu(torch.autograd.Function):  # type: ignore[misc]
        """gelu(x + bias) (exact erf), exported as com.microsoft BiasGelu: one kernel where a Gemm's bias
        broadcast and a Gelu were two."""

        @staticmethod
        def forward(ctx: Any, x: Any, bias: Any) -> Any:
            return torch.nn.functional.gelu(x + bias)

        @staticmethod
        def symbolic(g: Any, x: Any, bias: Any) -> Any:
            out = g.op("com.microsoft::BiasGelu", x, bias)
            out.setType(x.type())
            return out

    class SkipLayerNorm(torch.autograd.Function):  # type: ignore[misc]
        """(layer_norm(x + skip + bias), x + skip + bias), exported as com.microsoft
        SkipLayerNormalization with its sum output: one kernel where a Gemm's bias broadcast, the
        residual Add and the LayerNormalization were three (onnxruntime's own SkipLayerNorm fusion does
        not fire here: its MatMul+Add fusion makes the projection a Gemm first)."""

        @staticmethod
        def forward(ctx: Any, x: Any, skip: Any, gamma: Any, beta: Any, bias: Any, eps: float) -> Any:
            total = x + skip + bias
            return torch.nn.functional.layer_norm(total, (total.shape[-1],), gamma, beta, eps), total

        @staticmethod
        def symbolic(g: Any, x: Any, skip: Any, gamma: Any, beta: Any, bias: Any, eps: float) -> Any:
            # outputs: normalized, mean, inv_std_var (unread: export_stage leaves them out), the sum
            out = g.op("com.microsoft::SkipLayerNormalization", x, skip, gamma, beta, bias, epsilon_f=eps,
                       outputs=4)
            out[0].setType(x.type())
            out[3].setType(x.type())
            return out[0], out[3]

    return MultiHeadAttention, ScatterRows, BiasGelu, SkipLayerNorm


def plain_gelu_in(ff: Any) -> bool:
    """Whether a feed-forward block projects through an exact-erf GELU with a bias (matcha's
    FeedForward with activation "gelu", CosyVoice 2's), which BiasGelu can take."""
    act = ff.net[0]
    return type(act).__name__ == "GELU" and act.approximate == "none" and act.proj.bias is not None


def fusable(block: Any) -> bool:
    """Whether a block fits the fused graph's operators (CosyVoice 2's do): affine LayerNorms, biased
    attention and feed-forward output projections (SkipLayerNormalization takes their biases), the
    feed-forward an exact-erf GELU projection (BiasGelu), dropouts (identity in eval) and a Linear."""
    nn = _torch().nn
    ff = list(block.ff.net)
    norms = (block.norm1, block.norm3)
    outs = (block.attn1.to_out[0], ff[-1])  # (the feed-forward's: diffusers' LoRACompatibleLinear, a Linear)
    return (all(isinstance(n, nn.LayerNorm) and n.weight is not None and n.bias is not None for n in norms)
            and all(isinstance(o, nn.Linear) and o.bias is not None for o in outs) and plain_gelu_in(block.ff)
            and all(isinstance(mod, nn.Dropout) for mod in ff[1:-1]))
