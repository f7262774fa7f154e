"""`cosyedge build tiny`: a randomly initialised CosyVoice 2 checkpoint in
the official layout. The weights come from the upstream modules themselves
(built from the yaml written here), so they load with strict=True exactly as
a real CosyVoice2-0.5B directory does."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import cosyedge_build.checkpoint.tiny_onnx as tiny_onnx
import cosyedge_build.checkpoint.tiny_tokenizer as tiny_tokenizer
import cosyedge_build.reference.modules as reference
import numpy as np
from cosyedge_build.checkpoint.tiny_sizes import PRESETS, CheckpointSizes, render_yaml
from cosyedge_build.reference.modules import QWEN_DIR, require
from cosyedge_build.scratch_dir import check_new_dir, scratch_for
from cosyedge_models.errors import CosyEdgeError

log = logging.getLogger(__name__)

SPEAKER_EMBEDDING_DIM = 192
# HiFT init: log-magnitude offset (audio at ~0.07 RMS, far from clipping)
# and the F0 the random predictor centres on (mostly voiced speech)
_HIFT_LOG_MAGNITUDE = 0.0
_F0_CENTRE_HZ = 140.0
_F0_SPREAD_HZ = 90.0


def sizes_for(size: str, **overrides: Any) -> CheckpointSizes:
    if size not in PRESETS:
        raise CosyEdgeError(f"unknown checkpoint size '{size}'; allowed: {', '.join(PRESETS)}")
    return PRESETS[size].with_overrides(**overrides)


def build_tiny_checkpoint(out: Path, seed: int = 0, size: str = "tiny", **overrides: Any) -> Path:
    """Write a random CosyVoice 2 checkpoint of the given size preset
    (`tiny`, `tiny2`, `full`; fields of CheckpointSizes override it) to `out`.
    Built in a scratch folder beside `out` and renamed into place, so a
    failed build leaves nothing half-written."""
    sizes = sizes_for(size, **overrides)
    out = Path(out)
    check_new_dir(out, "checkpoint")
    with scratch_for(out) as scratch:
        _write_checkpoint(scratch, sizes, seed)
    log.info("wrote a %s CosyVoice 2 checkpoint (seed %d) to %s", size, seed, out)
    return out


def _write_checkpoint(out: Path, sizes: CheckpointSizes, seed: int) -> None:
    torch = require("torch", "torch", "building a tiny checkpoint")
    rng = np.random.default_rng(seed)
    qwen_dir = out / QWEN_DIR
    tokenizer = tiny_tokenizer.train_tokenizer(sizes.bpe_vocab_size)
    tiny_tokenizer.write_qwen_tokenizer_files(tokenizer, qwen_dir)
    text_vocab = _text_vocab_size(out, sizes)
    _write_qwen(qwen_dir, sizes, text_vocab, tokenizer.token_to_id("<|endoftext|>"), seed)

    yaml_text = render_yaml(sizes)
    (out / reference.YAML_NAME).write_text(yaml_text, encoding="utf-8")
    modules = reference.instantiate(out, yaml_text)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _init_llm_head(modules["llm"], sizes, generator)
        _shuffle_parameters(modules["flow"], generator)
        _shuffle_parameters(modules["hift"], generator)
        _init_hift(modules["hift"], generator)
    torch.save(modules["llm"].state_dict(), out / "llm.pt")
    torch.save(modules["flow"].state_dict(), out / "flow.pt")
    torch.save(modules["hift"].state_dict(), out / "hift.pt")

    tiny_onnx.write_campplus(out / "campplus.onnx", rng)
    tiny_onnx.write_speech_tokenizer(out / "speech_tokenizer_v2.onnx", rng)
    embedding = torch.from_numpy(rng.standard_normal((1, SPEAKER_EMBEDDING_DIM)).astype(np.float32))
    torch.save({"default": {"embedding": embedding}}, out / "spk2info.pt")


def _text_vocab_size(out: Path, sizes: CheckpointSizes) -> int:
    """Qwen2's vocab must cover the tokenizer after upstream's QwenTokenizer
    adds CosyVoice's special tokens; rounded up to 64 like Qwen's."""
    needed = len(reference.load_qwen_tokenizer(out).tokenizer)
    if sizes.text_vocab_size is None:
        return int(math.ceil(needed / 64) * 64)
    if sizes.text_vocab_size < needed:
        raise CosyEdgeError(
            f"text_vocab_size {sizes.text_vocab_size} is smaller than the tokenizer ({needed})"
        )
    return sizes.text_vocab_size


def _write_qwen(qwen_dir: Path, sizes: CheckpointSizes, vocab: int, eos_id: int, seed: int) -> None:
    torch = require("torch", "torch", "building a tiny checkpoint")
    transformers = require("transformers", "transformers", "building a tiny checkpoint")
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.num_heads,
        num_key_value_heads=sizes.num_kv_heads,
        max_position_embeddings=sizes.max_position_embeddings,
        rope_theta=sizes.rope_theta,
        rms_norm_eps=sizes.rms_norm_eps,
        tie_word_embeddings=True,
        hidden_act="silu",
        initializer_range=0.02,
        use_sliding_window=False,
        sliding_window=sizes.max_position_embeddings,
        max_window_layers=sizes.num_layers,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)  # HF initialises from the global generator: N(0, 0.02), norms at 1
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its sliding-window note (the window is off)
    try:
        model = transformers.Qwen2ForCausalLM(config)
    finally:
        transformers.logging.set_verbosity(verbosity)
    model.to(torch.bfloat16).save_pretrained(str(qwen_dir), safe_serialization=True)
    gen_config = {
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "max_new_tokens": 2048,
        "do_sample": False,
        "transformers_version": transformers.__version__,
    }
    (qwen_dir / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")


def _init_llm_head(llm: Any, sizes: CheckpointSizes, generator: Any) -> None:
    """Speech embeddings like Qwen's (N(0, 0.02)); a speech-token head whose
    logits spread like a trained one's, with an EOS that becomes likely only
    sometimes (so the random LLM neither stops at once nor never)."""
    llm.llm_embedding.weight.normal_(0.0, 0.02, generator=generator)
    llm.speech_embedding.weight.normal_(0.0, 0.02, generator=generator)
    head = llm.llm_decoder
    head.weight.normal_(0.0, sizes.llm_logit_std / math.sqrt(head.in_features), generator=generator)
    head.bias.zero_()
    head.bias[llm.speech_token_size] = sizes.llm_eos_bias


def _shuffle_parameters(module: Any, generator: Any) -> None:
    """Upstream's CFM calls set_all_random_seed(0) while it is built, so the
    flow and HiFT weights it initialises after that are the same for every
    seed. Permuting each tensor's values keeps upstream's init statistics
    exactly and makes the weights depend on our seed."""
    torch = require("torch", "torch", "building a tiny checkpoint")
    for param in module.parameters():
        flat = param.data.view(-1)
        flat.copy_(flat[torch.randperm(flat.numel(), generator=generator)])


def _init_hift(hift: Any, generator: Any) -> None:
    """Upstream's init gives quiet audio and an F0 near zero (all unvoiced);
    shift both into a speech-like range. The F0 network is rescaled so that
    its hidden activations are O(1), as in a trained network (tiny ones
    feeding a huge head would make F0 needlessly sensitive to rounding),
    and its head maps them to a voiced F0 spread."""
    n_bins = hift.istft_params["n_fft"] // 2 + 1
    hift.conv_post.bias[:n_bins] = _HIFT_LOG_MAGNITUDE
    predictor = hift.f0_predictor
    x = torch_randn_like_mel(predictor, generator)
    for layer in predictor.condnet:
        if hasattr(layer, "parametrizations"):  # weight norm: scale its magnitude g
            pre = layer(x)
            layer.parametrizations.weight.original0.mul_(1.0 / max(float(pre.std()), 1e-6))
        x = layer(x)
    classifier = predictor.classifier
    std = _F0_SPREAD_HZ / (max(float(x.std()), 1e-6) * math.sqrt(classifier.in_features))
    classifier.weight.normal_(0.0, std, generator=generator)
    classifier.bias.fill_(_F0_CENTRE_HZ)


def torch_randn_like_mel(predictor: Any, generator: Any, frames: int = 200) -> Any:
    torch = require("torch", "torch", "building a tiny checkpoint")
    in_channels = predictor.condnet[0].in_channels
    return torch.randn(1, in_channels, frames, generator=generator) * 1.5
