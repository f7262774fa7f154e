"""The LLM stages: our own Qwen2 decoder loop over the upstream layers'
projections and norms (prefill over a left-padded prompt, and a decode
call of T new positions over a KV cache: T = 1 per generated token, T > 1
to prefill the rest of a prompt after a saved voice's cached prefix),
ending in CosyVoice's speech-token head."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_build.export.graphs import MASK_NEGATIVE, StageGraph, TensorSpec, export_stage, module_base
from cosyedge_build.reference.modules import require
from cosyedge_models.errors import CheckpointError

# prompt length (sos + text + task + prompt speech) and generated tokens on a board
PREFILL_T = [1, 128, 512]
DECODE_TOKENS_MAX = 1024
PREFIX_POSITIONS_MAX = 256  # a saved voice's LLM prefix (sos + its transcript) on TensorRT
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


def _qwen2_core(llm: Any) -> Any:
    """The module both LLM graph forms share: the upstream layers' weights,
    RoPE, and one pass over the layers where `attend_kv` supplies each
    layer's keys and values (the new ones joined to the cache)."""
    torch = _torch()
    config = llm.llm.model.config
    scaling = getattr(config, "rope_scaling", None)
    # transformers >= 5 reports plain RoPE as {"rope_type": "default", "rope_theta": ...}
    if scaling and not (isinstance(scaling, dict) and scaling.get("rope_type", "default") == "default"):
        raise CheckpointError(f"Qwen2 rope_scaling {config.rope_scaling} is not supported (expected none)")
    if getattr(config, "use_sliding_window", False):
        raise CheckpointError("Qwen2 use_sliding_window=true is not supported (CosyVoice 2 has it off)")
    dims = llm_dims(llm)

    class Qwen2Core(module_base()):  # type: ignore[misc]
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

        def rope(self, positions: Any) -> tuple[Any, Any]:
            """cos, sin [B, 1, T, hd] for positions [B, T]."""
            freqs = positions.unsqueeze(-1).float() * self.inv_freq  # [B, T, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            return (emb.cos() * self.rope_scale).unsqueeze(1), (emb.sin() * self.rope_scale).unsqueeze(1)

        def layers_pass(self, h: Any, cos: Any, sin: Any, bias: Any, attend_kv: Any) -> tuple[Any, Any]:
            """log-probs at the last position and the stacked caches [L, 2, B, Hkv, S, hd]."""
            b, t = h.shape[0], h.shape[1]
            group = self.n_heads // self.n_kv
            presents = []
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                x = self.rms(layer.input_layernorm, h)
                q = attn.q_proj(x).view(b, t, self.n_heads, self.hd).transpose(1, 2)
                k = attn.k_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
                v = attn.v_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
                q = q * cos + self.rotate_half(q) * sin
                k = k * cos + self.rotate_half(k) * sin
                k, v = attend_kv(i, k, v)
                presents.append(torch.stack((k, v)))
                total = k.shape[2]
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
            return torch.log_softmax(self.head(last), dim=-1), torch.stack(presents)

    return Qwen2Core


def make_qwen2_graph(llm: Any, with_past: bool) -> Any:
    torch = _torch()
    core = _qwen2_core(llm)

    class Qwen2Graph(core):  # type: ignore[misc,valid-type]
        """inputs_embeds (+ past) -> speech-token log-probs at the last
        position and the KV cache [L, 2, B, Hkv, P + T, hd]."""

        def forward(self, inputs_embeds: Any, attention_mask: Any, past_kv: Any = None) -> Any:
            t = inputs_embeds.shape[1]
            key_valid = attention_mask > 0  # [B, P + T]
            total = attention_mask.shape[1]
            past = total - t
            # positions count real tokens only, so left padding does not shift them
            positions = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)[:, past:]
            cos, sin = self.rope(positions)
            query_pos = torch.arange(t, device=inputs_embeds.device) + past
            key_pos = torch.arange(total, device=inputs_embeds.device)
            allowed = (key_pos[None, :] <= query_pos[:, None])[None] & key_valid[:, None, :]  # [B, T, P+T]
            bias = torch.where(allowed, 0.0, MASK_NEGATIVE).unsqueeze(1).to(inputs_embeds.dtype)

            def attend_kv(i: int, k: Any, v: Any) -> tuple[Any, Any]:
                if past_kv is None:
                    return k, v
                return torch.cat((past_kv[i, 0], k), dim=2), torch.cat((past_kv[i, 1], v), dim=2)

            return self.layers_pass(inputs_embeds, cos, sin, bias, attend_kv)

    return Qwen2Graph().eval()


def make_qwen2_static_decode(llm: Any) -> Any:
    """One decode step of one request over a fixed-size cache (every shape
    static, so no shape arithmetic is left for onnxruntime to put on the CPU
    and the CUDA provider can capture the step as a CUDA graph): the new
    K/V are written at `position` by a select (exact), attention masks the
    positions after it. Same arithmetic as the dynamic step: masked keys get
    exactly zero weight."""
    torch = _torch()
    core = _qwen2_core(llm)

    class Qwen2StaticDecode(core):  # type: ignore[misc,valid-type]
        def forward(self, inputs_embeds: Any, position: Any, past_kv: Any) -> Any:
            size = past_kv.shape[4]
            cos, sin = self.rope(position.view(1, 1))
            slots = torch.arange(size, device=inputs_embeds.device)
            bias = torch.where(slots <= position, 0.0, MASK_NEGATIVE).to(inputs_embeds.dtype).view(1, 1, 1, size)
            write = (slots == position).view(1, 1, size, 1)

            def attend_kv(i: int, k: Any, v: Any) -> tuple[Any, Any]:
                return torch.where(write, k, past_kv[i, 0]), torch.where(write, v, past_kv[i, 1])

            return self.layers_pass(inputs_embeds, cos, sin, bias, attend_kv)

    return Qwen2StaticDecode().eval()


def make_kv_pad(size: int) -> Any:
    """The prefill's cache [L, 2, 1, Hkv, T, hd] zero-padded to `size` positions (the static step's input)."""
    torch = _torch()

    class KvPad(module_base()):  # type: ignore[misc]
        def forward(self, present_kv: Any) -> Any:
            return torch.nn.functional.pad(present_kv, (0, 0, 0, size - present_kv.shape[4]))

    return KvPad().eval()


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
        # T new positions (1 per decode step; more for a prefill after a cached prefix).
        inputs = [
            TensorSpec("inputs_embeds", "float32", ("B", "T", d)),
            TensorSpec("attention_mask", "int64", ("B", "P+T")),
            TensorSpec("past_kv", "float32", (n_l, 2, "B", n_kv, "P", hd)),
        ]
        outputs = [
            TensorSpec("logp", "float32", ("B", v)),
            TensorSpec("present_kv", "float32", (n_l, 2, "B", n_kv, "P+T", hd)),
        ]
    return inputs, outputs


def static_decode_stages(llm: Any, out: Path, size: int) -> list[StageGraph]:
    """llm_decode_static.onnx (one step over a `size`-position cache, every
    shape fixed) and llm_kv_pad.onnx (the prefill's cache padded to it): the
    CUDA-graph decode loop of ort-cuda (models/backends/ort_graph_decode.py).
    Opt-in (`build export --static-decode-len`): the step graph carries its
    own copy of the LLM weights."""
    torch = _torch()
    dims = llm_dims(llm)
    d, n_l, n_kv, hd, v = (dims["hidden_size"], dims["num_layers"], dims["num_kv_heads"], dims["head_dim"],
                           dims["speech_vocab_size"])
    if size < 2:
        raise CheckpointError(f"static decode length must be >= 2 positions, got {size}")
    cache = (n_l, 2, 1, n_kv, size, hd)
    step = StageGraph(
        "llm_decode_static", "llm_decode_static.onnx",
        [TensorSpec("inputs_embeds", "float32", (1, 1, d)), TensorSpec("position", "int64", (1,)),
         TensorSpec("past_kv", "float32", cache)],
        [TensorSpec("logp", "float32", (1, v)), TensorSpec("present_kv", "float32", cache)],
        {}, extra={"positions": size},
    )
    example: tuple[Any, ...] = (torch.randn(1, 1, d) * 0.02, torch.tensor([3]), torch.randn(*cache))
    stages = [export_stage(make_qwen2_static_decode(llm), example, out, step)]
    pad = StageGraph(
        "llm_kv_pad", "llm_kv_pad.onnx",
        [TensorSpec("present_kv", "float32", (n_l, 2, 1, n_kv, "T", hd))],
        [TensorSpec("padded_kv", "float32", cache)],
        {"T": [1, PREFILL_T[1], size]}, extra={"positions": size},
    )
    stages.append(export_stage(make_kv_pad(size), (torch.randn(n_l, 2, 1, n_kv, 5, hd),), out, pad))
    return stages


def export_llm(llm: Any, out: Path, static_decode_len: int = 0) -> tuple[list[StageGraph], dict[str, Path]]:
    """llm_prefill.onnx, llm_decode.onnx (and with `static_decode_len` the
    static step and its pad graph) and the embedding tables."""
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
    example = (  # 3 new positions: the traced graph keeps T symbolic
        torch.randn(2, 3, d) * 0.02,
        torch.ones(2, 8, dtype=torch.int64),
        torch.randn(n_l, 2, 2, n_kv, 5, hd),
    )
    decode_max = PREFILL_T[2] + DECODE_TOKENS_MAX - 1
    # Two TensorRT optimization profiles, so that one engine serves the whole LLM (one copy of
    # its weights, `build engines` then builds no llm_prefill engine): the steps (one new
    # position over a growing past) and the prefill (T new positions over an empty past, or
    # over a saved voice's prefix of up to PREFIX_POSITIONS_MAX). onnxruntime ignores profiles.
    profile = [{"B": BATCH, "P": [1, 256, decode_max], "T": [1, 1, 1]},
               {"B": BATCH, "P": [0, 0, PREFIX_POSITIONS_MAX], "T": PREFILL_T}]
    stages.append(
        export_stage(
            make_qwen2_graph(llm, with_past=True),
            example,
            out,
            StageGraph("llm_decode", "llm_decode.onnx", inputs, outputs, profile),
        )
    )
    if static_decode_len:
        stages.extend(static_decode_stages(llm, out, static_decode_len))

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
