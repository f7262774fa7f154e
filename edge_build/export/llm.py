"""The LLM stages: our own Qwen2 decoder loop over the upstream layers'
projections and norms (prefill over a left-padded prompt, and one decode
step with a KV cache), ending in CosyVoice's speech-token head."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edge_build.export.graphs import MASK_NEGATIVE, StageGraph, TensorSpec, export_stage, module_base
from edge_build.reference import require
from models.errors import CheckpointError

# prompt length (sos + text + task + prompt speech) and generated tokens on a board
PREFILL_T = [1, 128, 512]
DECODE_TOKENS_MAX = 1024
BATCH = [1, 1, 4]


def _torch() -> Any:
    return require("torch", "torch", "exporting the LLM")


def llm_dims(llm: Any) -> dict[str, int]:
    config = llm.llm.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        "hidden_size": int(config.hidden_size),
        "num_layers": int(config.num_hidden_layers),
        "num_heads": int(config.num_attention_heads),
        "num_kv_heads": int(config.num_key_value_heads),
        "head_dim": int(head_dim),
        "speech_token_size": int(llm.speech_token_size),
        "speech_vocab_size": int(llm.llm_decoder.out_features),
        "text_vocab_size": int(llm.llm.model.model.embed_tokens.num_embeddings),
    }


def make_qwen2_graph(llm: Any, with_past: bool) -> Any:
    torch = _torch()
    config = llm.llm.model.config
    if getattr(config, "rope_scaling", None):
        raise CheckpointError(f"Qwen2 rope_scaling {config.rope_scaling} is not supported (expected none)")
    if getattr(config, "use_sliding_window", False):
        raise CheckpointError("Qwen2 use_sliding_window=true is not supported (CosyVoice 2 has it off)")
    dims = llm_dims(llm)

    class Qwen2Graph(module_base()):  # type: ignore[misc]
        """inputs_embeds (+ past) -> speech-token log-probs at the last
        position and the KV cache [L, 2, B, Hkv, P + T, hd]."""

        def __init__(self) -> None:
            super().__init__()
            qwen = llm.llm.model.model
            self.layers = qwen.layers
            self.norm = qwen.norm
            self.head = llm.llm_decoder
            self.register_buffer(
                "inv_freq", qwen.rotary_emb.inv_freq.detach().clone().float(), persistent=False
            )
            self.rope_scale = float(qwen.rotary_emb.attention_scaling)
            self.n_heads, self.n_kv, self.hd = dims["num_heads"], dims["num_kv_heads"], dims["head_dim"]

        @staticmethod
        def rms(norm: Any, x: Any) -> Any:
            variance = x.pow(2).mean(-1, keepdim=True)
            return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))

        @staticmethod
        def rotate_half(x: Any) -> Any:
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

        def forward(self, inputs_embeds: Any, attention_mask: Any, past_kv: Any = None) -> Any:
            b, t = inputs_embeds.shape[0], inputs_embeds.shape[1]
            key_valid = attention_mask > 0  # [B, P + T]
            total = attention_mask.shape[1]
            past = total - t
            # positions count real tokens only, so left padding does not shift them
            positions = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)[:, past:]
            freqs = positions.unsqueeze(-1).float() * self.inv_freq  # [B, T, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * self.rope_scale).unsqueeze(1)
            sin = (emb.sin() * self.rope_scale).unsqueeze(1)
            query_pos = torch.arange(t, device=inputs_embeds.device) + past
            key_pos = torch.arange(total, device=inputs_embeds.device)
            allowed = (key_pos[None, :] <= query_pos[:, None])[None] & key_valid[:, None, :]  # [B, T, P+T]
            bias = torch.where(allowed, 0.0, MASK_NEGATIVE).unsqueeze(1).to(inputs_embeds.dtype)
            group = self.n_heads // self.n_kv
            h = inputs_embeds
            presents = []
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                x = self.rms(layer.input_layernorm, h)
                q = attn.q_proj(x).view(b, t, self.n_heads, self.hd).transpose(1, 2)
                k = attn.k_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
                v = attn.v_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
                q = q * cos + self.rotate_half(q) * sin
                k = k * cos + self.rotate_half(k) * sin
                if past_kv is not None:
                    k = torch.cat((past_kv[i, 0], k), dim=2)
                    v = torch.cat((past_kv[i, 1], v), dim=2)
                presents.append(torch.stack((k, v)))
                k_all = k.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(b, self.n_heads, total, self.hd)
                v_all = v.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(b, self.n_heads, total, self.hd)
                scores = torch.matmul(q, k_all.transpose(-1, -2)) * attn.scaling + bias
                ctx = torch.matmul(torch.softmax(scores, dim=-1), v_all)
                ctx = ctx.transpose(1, 2).reshape(b, t, self.n_heads * self.hd)
                h = h + attn.o_proj(ctx)
                x = self.rms(layer.post_attention_layernorm, h)
                mlp = layer.mlp
                h = h + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
            last = self.rms(self.norm, h[:, -1])
            logp = torch.log_softmax(self.head(last), dim=-1)
            return logp, torch.stack(presents)

    return Qwen2Graph().eval()


def _specs(dims: dict[str, int], with_past: bool) -> tuple[list[TensorSpec], list[TensorSpec]]:
    d, n_l, n_kv, hd, v = (
        dims["hidden_size"],
        dims["num_layers"],
        dims["num_kv_heads"],
        dims["head_dim"],
        dims["speech_vocab_size"],
    )
    if not with_past:
        inputs = [
            TensorSpec("inputs_embeds", "float32", ("B", "T", d)),
            TensorSpec("attention_mask", "int64", ("B", "T")),
        ]
        outputs = [
            TensorSpec("logp", "float32", ("B", v)),
            TensorSpec("present_kv", "float32", (n_l, 2, "B", n_kv, "T", hd)),
        ]
    else:
        inputs = [
            TensorSpec("inputs_embeds", "float32", ("B", 1, d)),
            TensorSpec("attention_mask", "int64", ("B", "P+1")),
            TensorSpec("past_kv", "float32", (n_l, 2, "B", n_kv, "P", hd)),
        ]
        outputs = [
            TensorSpec("logp", "float32", ("B", v)),
            TensorSpec("present_kv", "float32", (n_l, 2, "B", n_kv, "P+1", hd)),
        ]
    return inputs, outputs


def export_llm(llm: Any, out: Path) -> tuple[list[StageGraph], dict[str, Path]]:
    """llm_prefill.onnx, llm_decode.onnx and the embedding tables."""
    torch = _torch()
    dims = llm_dims(llm)
    d, n_l, n_kv, hd = dims["hidden_size"], dims["num_layers"], dims["num_kv_heads"], dims["head_dim"]
    stages = []
    inputs, outputs = _specs(dims, with_past=False)
    example: tuple[Any, ...] = (torch.randn(2, 5, d) * 0.02, torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
    stages.append(
        export_stage(
            make_qwen2_graph(llm, with_past=False),
            example,
            out,
            StageGraph("llm_prefill", "llm_prefill.onnx", inputs, outputs, {"B": BATCH, "T": PREFILL_T}),
        )
    )
    inputs, outputs = _specs(dims, with_past=True)
    example = (
        torch.randn(2, 1, d) * 0.02,
        torch.ones(2, 6, dtype=torch.int64),
        torch.randn(n_l, 2, 2, n_kv, 5, hd),
    )
    decode_max = PREFILL_T[2] + DECODE_TOKENS_MAX - 1
    stages.append(
        export_stage(
            make_qwen2_graph(llm, with_past=True),
            example,
            out,
            StageGraph(
                "llm_decode", "llm_decode.onnx", inputs, outputs, {"B": BATCH, "P": [1, 256, decode_max]}
            ),
        )
    )

    arrays = {
        "text_embedding": ("llm_text_embedding.npy", llm.llm.model.model.embed_tokens.weight),
        "speech_embedding": ("llm_speech_embedding.npy", llm.speech_embedding.weight),
        "special_embedding": ("llm_special_embedding.npy", llm.llm_embedding.weight),
    }
    written = {}
    for key, (file, weight) in arrays.items():
        np.save(out / file, weight.detach().float().cpu().numpy().astype(np.float32))
        written[key] = out / file
    return stages, written
