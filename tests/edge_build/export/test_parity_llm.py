"""llm_prefill / llm_decode in onnxruntime against upstream's Qwen2LM: the HF
Qwen2 forward through Qwen2Encoder, llm_decoder, and forward_one_step with
its DynamicCache, on prompts built the way Qwen2LM.inference builds them."""

from __future__ import annotations

import numpy as np
import torch

from tests.edge_build.conftest import Checkpoint
from tests.edge_build.parity import TOLERANCE, max_rel, to_numpy


def lm_input(llm, text: torch.Tensor, prompt_speech: torch.Tensor) -> torch.Tensor:
    """[sos_eos] + text_emb(text) + [task_id] + speech_emb(prompt speech)."""
    parts = [
        llm.llm_embedding.weight[llm.sos_eos].reshape(1, 1, -1),
        llm.llm.model.model.embed_tokens(text),
        llm.llm_embedding.weight[llm.task_id].reshape(1, 1, -1),
    ]
    if prompt_speech.shape[1]:
        parts.append(llm.speech_embedding(prompt_speech))
    return torch.cat(parts, dim=1)


def upstream_prefill(llm, x: torch.Tensor):
    """What Qwen2LM.inference_wrapper runs for the first step."""
    masks = torch.tril(torch.ones((1, x.shape[1], x.shape[1]))).to(torch.bool)
    y, cache = llm.llm.forward_one_step(x, masks=masks, cache=None)
    return llm.llm_decoder(y[:, -1]).log_softmax(dim=-1), cache


def cache_array(cache) -> np.ndarray:
    """DynamicCache -> [L, 2, B, Hkv, T, hd]."""
    return np.stack(
        [
            np.stack([to_numpy(k), to_numpy(v)])
            for k, v in zip(cache.key_cache, cache.value_cache, strict=True)
        ]
    )


def prompts(llm, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vocab = llm.llm.model.model.embed_tokens.num_embeddings
    shapes = [(9, 0), (4, 6), (13, 3)]  # (text tokens, prompt speech tokens)
    return [
        lm_input(
            llm,
            torch.randint(0, vocab, (1, n_text), generator=g),
            torch.randint(0, llm.speech_token_size, (1, n_speech), generator=g),
        )
        for n_text, n_speech in shapes
    ]


def left_pad(rows: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    t = max(r.shape[1] for r in rows)
    embeds = np.zeros((len(rows), t, rows[0].shape[2]), np.float32)
    mask = np.zeros((len(rows), t), np.int64)
    for i, r in enumerate(rows):
        embeds[i, t - r.shape[1] :] = to_numpy(r[0])
        mask[i, t - r.shape[1] :] = 1
    return embeds, mask


@torch.no_grad()
def test_prefill_matches_qwen2_forward_and_cache(checkpoint: Checkpoint) -> None:
    llm = checkpoint.refs.llm
    session = checkpoint.session("llm_prefill")
    for x in prompts(llm, seed=1):
        ref_logp, cache = upstream_prefill(llm, x)
        # the plain (no cache) forward through Qwen2Encoder gives the same last position
        hidden, _ = llm.llm(x, torch.tensor([x.shape[1]]))
        encoder_logp = llm.llm_decoder(hidden[:, -1]).log_softmax(dim=-1)
        logp, kv = session.run(
            None, {"inputs_embeds": to_numpy(x), "attention_mask": np.ones((1, x.shape[1]), np.int64)}
        )
        assert max_rel(logp, to_numpy(ref_logp)) < TOLERANCE
        assert max_rel(logp, to_numpy(encoder_logp)) < TOLERANCE
        assert max_rel(kv, cache_array(cache)) < TOLERANCE


@torch.no_grad()
def test_left_padded_batch_rows_equal_rows_alone(checkpoint: Checkpoint) -> None:
    llm = checkpoint.refs.llm
    session = checkpoint.session("llm_prefill")
    rows = prompts(llm, seed=2)
    embeds, mask = left_pad(rows)
    logp, kv = session.run(None, {"inputs_embeds": embeds, "attention_mask": mask})
    t = embeds.shape[1]
    for i, x in enumerate(rows):
        n = x.shape[1]
        ref_logp, cache = upstream_prefill(llm, x)
        alone_logp, alone_kv = session.run(
            None, {"inputs_embeds": to_numpy(x), "attention_mask": np.ones((1, n), np.int64)}
        )
        assert max_rel(logp[i], to_numpy(ref_logp[0])) < TOLERANCE
        assert max_rel(kv[:, :, i, :, t - n :], cache_array(cache)[:, :, 0]) < TOLERANCE
        assert max_rel(logp[i], alone_logp[0]) < TOLERANCE
        assert max_rel(kv[:, :, i, :, t - n :], alone_kv[:, :, 0]) < TOLERANCE
    assert np.isfinite(kv).all(), "padding positions must not hold NaN/inf (decode steps read them)"


@torch.no_grad()
def test_decode_steps_match_forward_one_step(checkpoint: Checkpoint) -> None:
    """Several steps, batch of left-padded rows, each row against upstream's
    own cached decoding of that row alone."""
    llm = checkpoint.refs.llm
    prefill, decode = checkpoint.session("llm_prefill"), checkpoint.session("llm_decode")
    rows = prompts(llm, seed=3)
    embeds, mask = left_pad(rows)
    _, kv = prefill.run(None, {"inputs_embeds": embeds, "attention_mask": mask})
    caches = [upstream_prefill(llm, x)[1] for x in rows]
    g = torch.Generator().manual_seed(4)
    step_mask = np.ones((1, 1), dtype=bool)
    for _ in range(3):
        tokens = torch.randint(0, llm.speech_token_size, (len(rows),), generator=g)
        step = llm.speech_embedding.weight[tokens].reshape(len(rows), 1, -1)
        mask = np.concatenate([mask, np.ones((len(rows), 1), np.int64)], axis=1)
        logp, kv = decode.run(None, {"inputs_embeds": to_numpy(step), "attention_mask": mask, "past_kv": kv})
        t = mask.shape[1]
        for i in range(len(rows)):
            y, caches[i] = llm.llm.forward_one_step(
                step[i : i + 1], masks=torch.from_numpy(step_mask)[None], cache=caches[i]
            )
            ref_logp = llm.llm_decoder(y[:, -1]).log_softmax(dim=-1)
            n = caches[i].key_cache[0].shape[2]
            assert max_rel(logp[i], to_numpy(ref_logp[0])) < TOLERANCE
            assert max_rel(kv[:, :, i, :, t - n :], cache_array(caches[i])[:, :, 0]) < TOLERANCE


def test_eos_is_possible_but_not_certain(checkpoint: Checkpoint) -> None:
    """The random LLM behaves: finite log-probs and an EOS that is neither
    certain nor impossible at the first step."""
    llm = checkpoint.refs.llm
    with torch.no_grad():
        x = prompts(llm, seed=5)[0]
        logp, _ = checkpoint.session("llm_prefill").run(
            None, {"inputs_embeds": to_numpy(x), "attention_mask": np.ones((1, x.shape[1]), np.int64)}
        )
    assert np.isfinite(logp).all()
    p_eos = float(np.exp(logp[0, llm.speech_token_size]))
    assert 1e-6 < p_eos < 0.5
    assert abs(float(np.exp(logp[0]).sum()) - 1.0) < 1e-4
