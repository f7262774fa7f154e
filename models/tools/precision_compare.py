"""How far a lower-precision bundle's output is from the fp32 one's, in the
same run (`cosyedge bench --compare`): speech-token agreement under one
seeded sampler (the LLM), and the mel SNR of both flows on the same tokens
(so that an LLM difference does not hide in it), with a count of non-finite
mel values (fp16 overflow shows there first)."""

from __future__ import annotations

from typing import Any

import numpy as np
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.llm import LlmInput
from cosyedge_models.synthesis.sampling import TokenSampler
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer


def speech_tokens(engine: CosyVoiceSynthesizer, text: str, seed: int) -> list[int]:
    """The LLM's tokens for the text's first segment under a seeded sampler."""
    config = engine.bundle.llm
    sampler = TokenSampler.seeded(config.sampling, config.eos_token, seed)
    segment = next(iter(engine.frontend.prepare(text)))
    return [int(t) for t in engine.lm.generate(LlmInput(text=segment.token_ids.tolist()), sampler)]


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    ref = np.asarray(reference, np.float64).ravel()
    err = ref - np.asarray(test, np.float64).ravel()
    noise = float(np.sum(err * err))
    if noise == 0.0:
        return float("inf")
    return float(10.0 * np.log10(max(float(np.sum(ref * ref)), 1e-30) / noise))


def accuracy(reference: CosyVoiceSynthesizer, other: CosyVoiceSynthesizer, text: str, seed: int = 0) -> dict[str, Any]:
    ref_tokens = speech_tokens(reference, text, seed)
    tokens = speech_tokens(other, text, seed)
    n = min(len(ref_tokens), len(tokens))
    same = int(np.sum(np.asarray(ref_tokens[:n]) == np.asarray(tokens[:n]))) if n else 0
    prefix = next((i for i in range(n) if ref_tokens[i] != tokens[i]), n)
    request = SynthesisRequest(text=text)
    toks = np.asarray(ref_tokens, np.int64)
    mel_ref = reference.flow.mel(toks, reference.conditioning.build(request).flow, finalize=True, streaming=False)
    mel = other.flow.mel(toks, other.conditioning.build(request).flow, finalize=True, streaming=False)
    return {"tokens_reference": len(ref_tokens), "tokens": len(tokens),
            "token_agreement": round(same / max(len(ref_tokens), len(tokens), 1), 4), "token_prefix_match": prefix,
            "mel_snr_db": round(snr_db(mel_ref, mel), 2), "mel_nonfinite": int(np.size(mel) - np.isfinite(mel).sum())}
