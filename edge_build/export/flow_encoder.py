"""The flow encoder stage: speech-token embedding, the pre-look-ahead
convolution, the conformer stacks before and after the x2 up-sampling, and
encoder_proj, as upstream's CausalMaskedDiffWithXvec.inference runs them,
but batched: masks come from token_len / lookahead_len / chunk_tokens.

Streaming caches (like the estimator's, see flow_estimator.py): with the
static chunk mask (full left context) the encoder is chunk-causal too, and
nothing in it depends on absolute positions (the ESPnet relative positional
encoding only sees query - key distances), so a call may take only the
tokens from the last committed chunk on plus caches:

* enc_cache [S, L1, 2, B, H, D]: K/V of the S committed tokens per layer of
  the first stack; up_cache [2*S, L2, 2, B, H, D]: the same for the stack
  after the x2 up-sampling (frames).
* pre_cache [B, C, 2]: the look-ahead layer's conv1 outputs of the two tokens
  before the window (its causal conv2 reads them); upconv_cache [B, C, 4]: the
  up-sampled frames before the window (the up-sampling conv reads 4).
* commit [R]: only its length is read: the window's first R tokens are
  committed. Outputs enc_cache_new [R, ...], up_cache_new [2*R, ...] (to
  append), pre_cache_new, upconv_cache_new.

Offline: S = R = 0 and zero pre/upconv caches (upstream's zero padding)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from cosyedge_build.export.graphs import MASK_NEGATIVE, StageGraph, TensorSpec, export_stage, module_base
from cosyedge_build.reference.modules import require
from cosyedge_models.errors import CheckpointError

TOKENS = [1, 150, 750]  # up to 30 s of speech (25 tokens/s), prompt included
BATCH = [1, 1, 4]
# offline calls (any batch, no cache) and streaming calls (one request; S
# committed tokens before the window, R committed by the call)
OFFLINE_PROFILE = {"B": BATCH, "T": TOKENS, "S": [0, 0, 0], "R": [0, 0, 0]}
STREAM_PROFILE = {"B": [1, 1, 1], "T": [1, 50, 750], "S": [0, 150, 750], "R": [0, 25, 750]}
GRAPH_VERSION = 2  # 1: no caches


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


def rel_positions(torch: Any, size: Any, div_term: Any, cached: Any = 0) -> Any:
    """ESPnet relative positional encoding [1, S + 2T - 1, D] for relative
    positions S+T-1 ... -(T-1) (T queries after S cached keys), interleaved
    sin/cos like upstream's table."""
    r = (cached + size - 1 - torch.arange(cached + 2 * size - 1)).float().unsqueeze(1)
    angles = r * div_term.unsqueeze(0)
    return torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1).reshape(1, cached + 2 * size - 1, -1)


def history(ext: Any, start: Any, k: int) -> Any:
    """A causal convolution's next history: the `k` frames of `ext` [B, C, T] from `start` (the
    committed frames; an int or [1] for every row, or [B]: one per row, the batched graphs')."""
    torch = _torch()
    if isinstance(start, torch.Tensor) and start.dim() == 1 and start.shape[0] > 1:
        at = (start.view(-1, 1, 1) + torch.arange(k).view(1, 1, k)).expand(ext.shape[0], ext.shape[1], k)
        return torch.gather(ext, 2, at)
    return ext.index_select(2, start + torch.arange(k))


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

        def attention(self, attn: Any, x: Any, bias: Any, pos_emb: Any, k_cache: Any,
                      v_cache: Any, idx: Any) -> tuple[Any, Any, Any]:
            """Returns the output and the window's K, V [B, H, T, D]; `idx` [T, S + T]: the
            column of the relative-position table each (query, key) pair reads."""
            b, t = x.shape[0], x.shape[1]
            h, dk = attn.h, attn.d_k
            s = k_cache.shape[2]
            q = attn.linear_q(x).view(b, t, h, dk)
            k = attn.linear_k(x).view(b, t, h, dk).transpose(1, 2)
            v = attn.linear_v(x).view(b, t, h, dk).transpose(1, 2)
            keys = torch.cat((k_cache, k), dim=2)
            values = torch.cat((v_cache, v), dim=2)
            p = attn.linear_pos(pos_emb).view(1, -1, h, dk).transpose(1, 2)
            ac = torch.matmul((q + attn.pos_bias_u).transpose(1, 2), keys.transpose(-2, -1))
            bd = torch.matmul((q + attn.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))
            bd = torch.gather(bd, 3, idx.reshape(-1, 1, t, s + t).expand(b, h, t, s + t))
            scores = (ac + bd) / math.sqrt(dk) + bias
            ctx = torch.matmul(torch.softmax(scores, dim=-1), values)
            return attn.linear_out(ctx.transpose(1, 2).reshape(b, t, h * dk)), k, v

        def layers(self, layers: Any, x: Any, valid_len: Any, chunk: Any, cache: Any,
                   keep: Any, cached_len: Any = None) -> tuple[Any, Any]:
            """The stack over the window with `cache` [S, L, 2, B, H, D] before it;
            returns x and the K/V of the window's `keep` frames [R, L, 2, B, H, D]
            (every window frame's with keep None). `cached_len` None: all S rows are
            committed frames; a tensor [1] (the fixed-shape graphs) or [B] (the batched
            ones: a length per row): only its first rows are, the rest of the buffer is masked."""
            t = x.shape[1]
            s = cache.shape[0]
            keys = torch.arange(t).view(1, 1, -1) < valid_len.view(-1, 1, 1)
            allowed = keys & chunk_allowed(torch, t, chunk)
            bias = torch.where(allowed, 0.0, MASK_NEGATIVE).unsqueeze(1)
            i, j = torch.arange(t).view(-1, 1), torch.arange(s + t).view(1, -1)
            if cached_len is None:
                # committed keys precede the window's chunks: always visible
                cache_bias = torch.zeros(bias.shape[0], 1, t, s, dtype=bias.dtype)
                # relative shift: query i (after s cached keys) and key j take relative
                # position s + i - j, i.e. column t - 1 - i + j of the table
                idx = (t - 1) - i + j
            else:
                n = cached_len.view(-1, 1, 1)
                used = torch.arange(s).view(1, -1) < cached_len.view(-1, 1)
                cache_bias = torch.where(used, 0.0, MASK_NEGATIVE).view(-1, 1, 1, s).expand(bias.shape[0], 1, t, s)
                # query i sits at n + i: cache row j < n is n + i - j back, window key s + j' is
                # i - j' back; a free row reads column 0 (masked), so the table keeps its static size
                rel = torch.where(j < s, torch.where(j < n, n + i - j, s + t - 1), s + i - j)
                idx = (s + t - 1) - rel
            bias = torch.cat((cache_bias, bias), dim=-1)
            pos_emb = rel_positions(torch, t, self.div_term, s)
            new = []
            for n_layer, layer in enumerate(layers):
                k_cache = cache[:, n_layer, 0].permute(1, 2, 0, 3)
                v_cache = cache[:, n_layer, 1].permute(1, 2, 0, 3)
                out, k, v = self.attention(layer.self_attn, layer.norm_mha(x), bias, pos_emb, k_cache, v_cache, idx)
                x = x + out
                x = x + layer.ff_scale * layer.feed_forward(layer.norm_ff(x))
                if keep is not None:
                    k, v = k.index_select(2, keep), v.index_select(2, keep)
                new.append(torch.stack((k, v), dim=0))
            # [L, 2, B, H, R, D] -> time-major [R, L, 2, B, H, D]
            return x, torch.stack(new, dim=0).permute(4, 0, 1, 2, 3, 5)

        def forward(
            self, token: Any, token_len: Any, lookahead_len: Any, chunk_tokens: Any, embedding: Any,
            enc_cache: Any, up_cache: Any, pre_cache: Any, upconv_cache: Any, commit: Any,
        ) -> tuple[Any, Any, Any, Any, Any, Any]:
            keep = torch.arange(commit.shape[0])  # window tokens committed by this call
            return self.core(token, token_len, lookahead_len, chunk_tokens, embedding, enc_cache, up_cache,
                             pre_cache, upconv_cache, keep.shape[0], keep, torch.arange(commit.shape[0] * self.stride))

        def core(self, token: Any, token_len: Any, lookahead_len: Any, chunk_tokens: Any, embedding: Any,
                 enc_cache: Any, up_cache: Any, pre_cache: Any, upconv_cache: Any, committed: Any, keep: Any,
                 keep_up: Any, cached_len: Any = None) -> tuple[Any, Any, Any, Any, Any, Any]:
            """The encoder over a window: `committed` tokens of it go to the caches (the conv
            histories are taken after them), `keep` / `keep_up` the K/V rows returned (None: all);
            `cached_len` as in layers()."""
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
            # conv2 is causal: the conv1 outputs of the tokens before the window come from the cache
            ext = torch.cat((pre_cache, y), dim=2)
            pre_new = history(ext, committed, pre_cache.shape[2])
            y = pre.conv2(ext)
            x = y.transpose(1, 2) + x
            main_len = token_len - lookahead_len
            x, enc_new = self.layers(encoder.encoders, x, main_len, chunk_tokens, enc_cache, keep, cached_len)
            # x2 nearest up-sampling, causal convolution (its history from the cache)
            up = encoder.up_layer
            y = (
                x.transpose(1, 2)
                .unsqueeze(-1)
                .expand(-1, -1, -1, self.stride)
                .reshape(x.shape[0], x.shape[2], t * self.stride)
            )
            ext = torch.cat((upconv_cache, y), dim=2)
            upconv_new = history(ext, committed * self.stride, upconv_cache.shape[2])
            y = up.conv(ext)
            x = self.embed(encoder.up_embed, y.transpose(1, 2))
            x, up_new = self.layers(encoder.up_encoders, x, main_len * self.stride, chunk_tokens * self.stride,
                                    up_cache, keep_up, None if cached_len is None else cached_len * self.stride)
            x = encoder.after_norm(x)
            mu = fl.encoder_proj(x).transpose(1, 2)
            return mu, spks, enc_new, up_new, pre_new, upconv_new

    return FlowEncoderGraph().eval()


def encoder_cache_dims(flow: Any) -> dict[str, int]:
    """What the runtime needs to size the encoder's caches (in the manifest)."""
    encoder = flow.encoder
    attn = encoder.encoders[0].self_attn
    pre, up = encoder.pre_lookahead_layer, encoder.up_layer
    return {
        "layers": len(encoder.encoders),
        "up_layers": len(encoder.up_encoders),
        "heads": int(attn.h),
        "head_dim": int(attn.d_k),
        "pre_channels": int(pre.conv2.in_channels),
        "pre_history": int(pre.conv2.kernel_size[0]) - 1,
        "upconv_channels": int(up.conv.in_channels),
        "upconv_history": int(up.conv.kernel_size[0]) - 1,
    }


def export_flow_encoder(flow: Any, out: Path) -> StageGraph:
    torch = _torch()
    mel, spk = int(flow.output_size), int(flow.spk_embed_affine_layer.in_features)
    ratio = int(flow.encoder.up_layer.stride)
    if ratio != int(flow.token_mel_ratio):
        raise CheckpointError(
            f"flow token_mel_ratio {flow.token_mel_ratio} differs from the encoder's "
            f"up-sampling stride {ratio}"
        )
    d = encoder_cache_dims(flow)
    if d["upconv_history"] != 2 * ratio or d["pre_history"] != 2:
        raise CheckpointError(f"flow encoder convolutions differ from CosyVoice 2's: {d}")
    t_out = "2T" if ratio == 2 else f"{ratio}T"
    s_up, r_up = ("2*S", "2*R") if ratio == 2 else (f"{ratio}*S", f"{ratio}*R")
    kv = (d["heads"], d["head_dim"])
    stage = StageGraph(
        "flow_encoder",
        "flow_encoder.onnx",
        [
            TensorSpec("token", "int64", ("B", "T")),
            TensorSpec("token_len", "int64", ("B",)),
            TensorSpec("lookahead_len", "int64", ("B",)),
            TensorSpec("chunk_tokens", "int64", ("B",)),
            TensorSpec("embedding", "float32", ("B", spk)),
            TensorSpec("enc_cache", "float32", ("S", d["layers"], 2, "B", *kv)),
            TensorSpec("up_cache", "float32", (s_up, d["up_layers"], 2, "B", *kv)),
            TensorSpec("pre_cache", "float32", ("B", d["pre_channels"], d["pre_history"])),
            TensorSpec("upconv_cache", "float32", ("B", d["upconv_channels"], d["upconv_history"])),
            TensorSpec("commit", "float32", ("R",)),
        ],
        [
            TensorSpec("mu", "float32", ("B", mel, t_out)),
            TensorSpec("spks", "float32", ("B", mel)),
            TensorSpec("enc_cache_new", "float32", ("R", d["layers"], 2, "B", *kv)),
            TensorSpec("up_cache_new", "float32", (r_up, d["up_layers"], 2, "B", *kv)),
            TensorSpec("pre_cache_new", "float32", ("B", d["pre_channels"], d["pre_history"])),
            TensorSpec("upconv_cache_new", "float32", ("B", d["upconv_channels"], d["upconv_history"])),
        ],
        [OFFLINE_PROFILE, STREAM_PROFILE],
        extra={"graph_version": GRAPH_VERSION, "cache": d},
    )
    # Trace with a non-empty cache and commit so that no size folds to a constant.
    past, b = 5, 2
    example = (
        torch.randint(0, int(flow.vocab_size), (b, 40)),
        torch.tensor([40, 31]),
        torch.tensor([3, 0]),
        torch.tensor([25, 0]),
        torch.randn(b, spk),
        torch.randn(past, d["layers"], 2, b, *kv),
        torch.randn(past * ratio, d["up_layers"], 2, b, *kv),
        torch.randn(b, d["pre_channels"], d["pre_history"]),
        torch.randn(b, d["upconv_channels"], d["upconv_history"]),
        torch.zeros(3),
    )
    return export_stage(make_flow_encoder_graph(flow), example, out, stage)
