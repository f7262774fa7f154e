"""The flow encoder stage: speech-token embedding, the pre-look-ahead
convolution, the conformer stacks before and after the x2 up-sampling, and
encoder_proj, as upstream's CausalMaskedDiffWithXvec.inference runs them,
but batched: masks come from token_len / lookahead_len / chunk_tokens."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from edge_build.export.graphs import MASK_NEGATIVE, StageGraph, TensorSpec, export_stage, module_base
from edge_build.reference import require
from models.errors import CheckpointError

TOKENS = [1, 150, 750]  # up to 30 s of speech (25 tokens/s), prompt included
BATCH = [1, 1, 4]


def _torch() -> Any:
    return require("torch", "torch", "exporting the flow encoder")


def chunk_allowed(torch: Any, size: Any, chunk: Any) -> Any:
    """[B, T, T] bool: upstream's static chunk mask (query i sees keys j <
    (i // c + 1) * c) per row; chunk <= 0 means full attention."""
    pos = torch.arange(size)
    c = chunk.view(-1, 1, 1)
    safe = torch.clamp(c, min=1)
    block_end = (torch.div(pos.view(1, -1, 1), safe, rounding_mode="trunc") + 1) * safe
    return (pos.view(1, 1, -1) < block_end) | (c <= 0)


def rel_positions(torch: Any, size: Any, div_term: Any) -> Any:
    """ESPnet relative positional encoding [1, 2T - 1, D] for relative
    positions T-1 ... -(T-1), interleaved sin/cos like upstream's table."""
    r = (size - 1 - torch.arange(2 * size - 1)).float().unsqueeze(1)
    angles = r * div_term.unsqueeze(0)
    return torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1).reshape(1, 2 * size - 1, -1)


def _check_encoder(encoder: Any) -> None:
    for layer in (*encoder.encoders, *encoder.up_encoders):
        if layer.conv_module is not None or layer.feed_forward_macaron is not None:
            raise CheckpointError(
                "the flow encoder uses conformer convolution/macaron modules, which "
                "CosyVoice 2 does not; this exporter does not support them"
            )
        if not layer.normalize_before:
            raise CheckpointError("the flow encoder is post-norm; CosyVoice 2's is pre-norm")
    kinds = {type(encoder.embed.pos_enc).__name__, type(encoder.up_embed.pos_enc).__name__}
    if kinds != {"EspnetRelPositionalEncoding"}:
        raise CheckpointError(f"flow encoder positional encoding {kinds}; expected rel_pos_espnet")
    if encoder.global_cmvn is not None:
        raise CheckpointError("the flow encoder has a global CMVN, which CosyVoice 2 does not")


def make_flow_encoder_graph(flow: Any) -> Any:
    torch = _torch()
    F = torch.nn.functional
    encoder = flow.encoder
    _check_encoder(encoder)
    d_model = encoder.output_size()
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))

    class FlowEncoderGraph(module_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.flow = flow
            self.register_buffer("div_term", div_term, persistent=False)
            self.stride = int(encoder.up_layer.stride)
            self.lookahead_pad = int(encoder.pre_lookahead_layer.pre_lookahead_len)

        @staticmethod
        def embed(sub: Any, x: Any) -> Any:
            linear, norm = sub.out[0], sub.out[1]
            return norm(linear(x)) * sub.pos_enc.xscale

        def attention(self, attn: Any, x: Any, bias: Any, pos_emb: Any) -> Any:
            b, t = x.shape[0], x.shape[1]
            h, dk = attn.h, attn.d_k
            q = attn.linear_q(x).view(b, t, h, dk)
            k = attn.linear_k(x).view(b, t, h, dk).transpose(1, 2)
            v = attn.linear_v(x).view(b, t, h, dk).transpose(1, 2)
            p = attn.linear_pos(pos_emb).view(1, -1, h, dk).transpose(1, 2)
            ac = torch.matmul((q + attn.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
            bd = torch.matmul((q + attn.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))
            # relative shift: entry (i, j) takes relative position i - j
            bd = torch.cat((torch.zeros_like(bd[..., :1]), bd), dim=-1)
            bd = bd.reshape(b, h, 2 * t, t)[:, :, 1:].reshape(b, h, t, 2 * t - 1)[..., :t]
            scores = (ac + bd) / math.sqrt(dk) + bias
            ctx = torch.matmul(torch.softmax(scores, dim=-1), v)
            return attn.linear_out(ctx.transpose(1, 2).reshape(b, t, h * dk))

        def layers(self, layers: Any, x: Any, valid_len: Any, chunk: Any) -> Any:
            t = x.shape[1]
            keys = torch.arange(t).view(1, 1, -1) < valid_len.view(-1, 1, 1)
            allowed = keys & chunk_allowed(torch, t, chunk)
            bias = torch.where(allowed, 0.0, MASK_NEGATIVE).unsqueeze(1)
            pos_emb = rel_positions(torch, t, self.div_term)
            for layer in layers:
                x = x + self.attention(layer.self_attn, layer.norm_mha(x), bias, pos_emb)
                x = x + layer.ff_scale * layer.feed_forward(layer.norm_ff(x))
            return x

        def forward(
            self, token: Any, token_len: Any, lookahead_len: Any, chunk_tokens: Any, embedding: Any
        ) -> Any:
            fl = self.flow
            t = token.shape[1]
            spks = fl.spk_embed_affine_layer(F.normalize(embedding, dim=1))
            valid = (torch.arange(t).view(1, -1) < token_len.view(-1, 1)).unsqueeze(-1).float()
            x = fl.input_embedding(torch.clamp(token, min=0)) * valid
            # what the look-ahead convolution sees: tokens (look-ahead incl.), zeros after them
            x = self.embed(encoder.embed, x) * valid
            pre = encoder.pre_lookahead_layer
            y = F.pad(x.transpose(1, 2), (0, self.lookahead_pad))
            y = F.leaky_relu(pre.conv1(y))
            y = pre.conv2(F.pad(y, (pre.conv2.kernel_size[0] - 1, 0)))
            x = y.transpose(1, 2) + x
            main_len = token_len - lookahead_len
            x = self.layers(encoder.encoders, x, main_len, chunk_tokens)
            # x2 nearest up-sampling, causal convolution
            up = encoder.up_layer
            y = (
                x.transpose(1, 2)
                .unsqueeze(-1)
                .expand(-1, -1, -1, self.stride)
                .reshape(x.shape[0], x.shape[2], t * self.stride)
            )
            y = up.conv(F.pad(y, (self.stride * 2, 0)))
            x = self.embed(encoder.up_embed, y.transpose(1, 2))
            x = self.layers(encoder.up_encoders, x, main_len * self.stride, chunk_tokens * self.stride)
            x = encoder.after_norm(x)
            mu = fl.encoder_proj(x).transpose(1, 2)
            return mu, spks

    return FlowEncoderGraph().eval()


def export_flow_encoder(flow: Any, out: Path) -> StageGraph:
    torch = _torch()
    mel, spk = int(flow.output_size), int(flow.spk_embed_affine_layer.in_features)
    ratio = int(flow.encoder.up_layer.stride)
    if ratio != int(flow.token_mel_ratio):
        raise CheckpointError(
            f"flow token_mel_ratio {flow.token_mel_ratio} differs from the encoder's "
            f"up-sampling stride {ratio}"
        )
    t_out = "2T" if ratio == 2 else f"{ratio}T"
    stage = StageGraph(
        "flow_encoder",
        "flow_encoder.onnx",
        [
            TensorSpec("token", "int64", ("B", "T")),
            TensorSpec("token_len", "int64", ("B",)),
            TensorSpec("lookahead_len", "int64", ("B",)),
            TensorSpec("chunk_tokens", "int64", ("B",)),
            TensorSpec("embedding", "float32", ("B", spk)),
        ],
        [TensorSpec("mu", "float32", ("B", mel, t_out)), TensorSpec("spks", "float32", ("B", mel))],
        {"B": BATCH, "T": TOKENS},
    )
    example = (
        torch.randint(0, int(flow.vocab_size), (2, 40)),
        torch.tensor([40, 31]),
        torch.tensor([3, 0]),
        torch.tensor([25, 0]),
        torch.randn(2, spk),
    )
    return export_stage(make_flow_encoder_graph(flow), example, out, stage)
