"""The accuracy report: a low-precision bundle against its fp32 source on
held-out texts, per stage and end to end."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_build.quantize.metrics import logits_cosine, matched_prefix, snr_db, top1_agreement
from cosyedge_build.quantize.settings import AccuracyBudget
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.llm import LlmInput
from cosyedge_models.synthesis.sampling import TokenSampler
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer


def _inputs(engine: CosyVoiceSynthesizer, text: str) -> tuple[list[LlmInput], Any]:
    cond = engine.conditioning.build(SynthesisRequest(text=text))
    segments = engine.frontend.prepare(text)
    return [LlmInput(text=s.token_ids.tolist(), prompt_text=cond.prompt_text, prompt_speech=cond.prompt_speech)
            for s in segments], cond


def _tokens(engine: CosyVoiceSynthesizer, inp: LlmInput, seed: int) -> list[int]:
    sampler = TokenSampler(engine.bundle.llm.sampling, engine.bundle.llm.eos_token, np.random.default_rng(seed))
    return list(engine.lm.generate(inp, sampler))


def _teacher_forced(engine: CosyVoiceSynthesizer, inp: LlmInput, tokens: Sequence[int]) -> np.ndarray:
    """logp at every step with the given tokens fed back: [steps, V]."""
    loop = engine.lm.decode_loop()
    try:
        rows = [loop.prefill(engine.lm.prompt_embeds(inp))[0]]
        for t in tokens:
            rows.append(loop.step(engine.lm.speech_embedding[t][None, None])[0])
    finally:
        loop.close()
    return np.stack(rows)


def compare_bundles(fp32_dir: Path, test_dir: Path, precision: str, texts: Sequence[str],
                    seed: int = 0) -> dict[str, float]:
    ref = load_synthesizer(fp32_dir, settings=SynthesisSettings(precision="fp32"))
    test = load_synthesizer(test_dir, settings=SynthesisSettings(precision=precision))
    cos: list[float] = []
    top1: list[float] = []
    mel_snr: list[float] = []
    wav_snr: list[float] = []
    match: list[float] = []
    try:
        for i, text in enumerate(texts):
            inputs, cond = _inputs(ref, text)
            for j, inp in enumerate(inputs):
                s = seed + 1000 * i + j
                tokens = _tokens(ref, inp, s)
                match.append(matched_prefix(tokens, _tokens(test, inp, s)))
                a, b = _teacher_forced(ref, inp, tokens), _teacher_forced(test, inp, tokens)
                cos.extend(logits_cosine(a, b).tolist())
                top1.append(top1_agreement(a, b))
                if not tokens:
                    continue
                arr = np.asarray(tokens, dtype=np.int64)
                mel = ref.flow.mel(arr, cond.flow, finalize=True, streaming=False)
                mel_snr.append(snr_db(mel, test.flow.mel(arr, cond.flow, finalize=True, streaming=False)))
                wav_a, _ = ref.vocoder.run(mel, np.random.default_rng(s))
                wav_b, _ = test.vocoder.run(mel, np.random.default_rng(s))
                wav_snr.append(snr_db(wav_a, wav_b))
    finally:
        ref.close()
        test.close()

    def mean(v: list[float]) -> float:
        return float(np.mean([min(x, 200.0) for x in v])) if v else float("nan")

    return {"llm_cosine": mean(cos), "llm_top1": mean(top1), "mel_snr_db": mean(mel_snr),
            "wav_snr_db": mean(wav_snr), "e2e_match": mean(match), "texts": float(len(texts))}


def failures(metrics: dict[str, float], budget: AccuracyBudget) -> list[str]:
    """Which stage misses the budget, in words (empty when all pass).
    NaN (a stage that produced NaN/Inf) fails every comparison."""
    checks = [
        ("llm", "logits cosine", metrics["llm_cosine"], budget.llm_cosine_min),
        ("llm", "top-1 agreement", metrics["llm_top1"], budget.llm_top1_min),
        ("flow", "mel SNR dB", metrics["mel_snr_db"], budget.mel_snr_min_db),
        ("vocoder", "waveform SNR dB", metrics["wav_snr_db"], budget.wav_snr_min_db),
        ("end-to-end", "matched token fraction", metrics["e2e_match"], budget.e2e_match_min),
    ]
    return [f"{stage}: {what} {value:.4g} < {floor:.4g}" for stage, what, value, floor in checks
            if not value >= floor]
