"""`cosyedge bench --voice NAME`: the saved voice's checks and the
`voice_cache` section: streaming first audio with the per-voice prompt cache
disabled and warm, in the same run, with what the cache holds and where each
path spent the time before its first chunk, and the LLM prefill alone with
and without the voice's LLM prefix (`llm_prefix`, `llm_prefill_off_ms`,
`llm_prefill_on_ms`)."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_models.errors import CosyEdgeError, RequestError
from cosyedge_models.synthesis.api import PromptAudio, StageEvent, SynthesisRequest
from cosyedge_models.synthesis.conditioning import Conditioning
from cosyedge_models.synthesis.features import load_audio
from cosyedge_models.synthesis.flow import prompt_commit_frames
from cosyedge_models.synthesis.llm import LlmInput
from cosyedge_models.synthesis.prompt import PromptFeatures
from cosyedge_models.synthesis.sampling import TokenSampler
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer
from cosyedge_models.synthesis.voice_cache import MIB

RunOnce = Callable[..., dict[str, Any]]


def check_voice(engine: CosyVoiceSynthesizer, voice: str) -> None:
    """The voice exists and serves zero_shot (it has a recording and its transcript)."""
    try:
        engine.validate(SynthesisRequest(text="-", mode="zero_shot", voice=voice))
    except RequestError as exc:
        raise CosyEdgeError(f"--voice {voice}: {exc}") from exc


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def first_chunk_ms(run: dict[str, Any]) -> dict[str, float]:
    """Stage time spent on chunk 0 (the first audio), per stage."""
    out: dict[str, float] = {}
    events: list[StageEvent] = run["timeline"]
    for e in events:
        if e.chunk == 0:
            out[e.stage] = round(out.get(e.stage, 0.0) + e.end_ms - e.start_ms, 1)
    return out


def voice_cache_report(engine: CosyVoiceSynthesizer, text: str, voice: str, repeats: int,
                       run_once: RunOnce) -> dict[str, Any]:
    """Streaming first audio with the voice cache off (each request computes
    the prompt's chunks itself) and warm (built before the first timed run),
    off and on runs alternated."""
    request = SynthesisRequest(text=text, mode="zero_shot", voice=voice)
    cond = engine.conditioning.build(request)
    segment = engine.frontend.prepare(text)[0]
    prefill = 1 + len(cond.prompt_text) + len(segment.token_ids) + 1 + len(cond.prompt_speech)
    report: dict[str, Any] = {
        "voice_cache_mb": engine.settings.voice_cache_mb,
        "prompt_tokens": int(cond.flow.tokens.size),
        "prompt_frames": int(cond.flow.feat.shape[0]),
        "cached_frames": prompt_commit_frames(engine.flow, cond.flow.tokens.size),
        # The LLM's input is [sos, prompt text, text, task, prompt speech]: only the first
        # two are independent of the request (the LLM prefix, docs/voice-cache.md).
        "llm_prefill_positions": prefill,
        "llm_cacheable_positions": 1 + len(cond.prompt_text),
    }
    original = engine.settings
    if original.voice_cache_mb == 0:
        raise CosyEdgeError("--voice measures the voice cache off and on; it needs --voice-cache-mb > 0")
    prefix = engine.warm_voice(request)
    report.update(llm_prefix_report(engine, cond, segment.token_ids.tolist(), max(repeats, 3)))
    if prefix is None:
        report["error"] = ("no prefix cached: the prompt has no complete flow chunk, or its cache is larger "
                           "than voice_cache_mb")
    else:
        report["prefix_mb"] = round(prefix.nbytes() / MIB, 1)
        report["build_ms"] = round(prefix.build_ms, 1)
    off: list[dict[str, Any]] = []
    on: list[dict[str, Any]] = []
    # Alternated, so that a change in the machine's load affects both sides alike.
    for r in range(repeats):
        try:
            engine.settings = dataclasses.replace(original, voice_cache_mb=0)
            off.append(run_once(engine, text, stream=True, seed=r, voice=voice))
        finally:
            engine.settings = original
        on.append(run_once(engine, text, stream=True, seed=r, voice=voice))
    off_ms = _median([r["first_audio_ms"] for r in off if r["first_audio_ms"] is not None])
    on_ms = _median([r["first_audio_ms"] for r in on if r["first_audio_ms"] is not None])
    report.update({
        "off_first_audio_ms": off_ms,
        "on_first_audio_ms": on_ms,
        "ratio": round(on_ms / off_ms, 3) if on_ms and off_ms else None,
        "off_first_chunk_stages_ms": first_chunk_ms(off[0]),
        "on_first_chunk_stages_ms": first_chunk_ms(on[0]),
        "off_first_audio_runs_ms": [round(r["first_audio_ms"] or 0.0, 1) for r in off],
        "on_first_audio_runs_ms": [round(r["first_audio_ms"] or 0.0, 1) for r in on],
    })
    return report


def llm_prefix_report(engine: CosyVoiceSynthesizer, cond: Conditioning, text: list[int],
                      repeats: int) -> dict[str, Any]:
    """The first segment's LLM prefill alone: the whole prompt (cache off) and
    the rest after the voice's cached LLM prefix (on), alternated after one
    warm-up of each, with the largest log-probability difference between them."""
    prefix = engine.llm_prefix(cond, "zero_shot")
    if prefix is None:
        why = ("TensorRT engines run single decode steps" if engine.bundle.backend == "trt" else
               "this bundle's llm_decode takes one new position (re-export it)" if not engine.lm.takes_prefix else
               "the voice's LLM prefix does not fit voice_cache_mb")
        return {"llm_prefix": f"off: {why}", "llm_prefix_positions": 0}
    full = engine.lm.prompt_embeds(LlmInput(text=text, prompt_text=cond.prompt_text,
                                            prompt_speech=cond.prompt_speech))
    rest = full[:, prefix.positions:]
    times: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}  # this process's CPU time: steadier on a shared machine
    logps = {}
    for r in range(repeats + 1):
        for on in (False, True):
            loop = engine.lm.decode_loop(full.shape[1] + 1)
            try:
                if on and not loop.takes_past:
                    return {"llm_prefix": "off: the decode loop cannot start from a saved cache",
                            "llm_prefix_positions": 0}
                t0, c0 = time.perf_counter(), time.process_time()
                logps[on] = loop.prefill(rest, prefix.kv) if on else loop.prefill(full)
                if r:  # the first round warms both shapes up
                    times[on].append((time.perf_counter() - t0) * 1e3)
                    cpu[on].append((time.process_time() - c0) * 1e3)
            finally:
                loop.close()
    off_ms, on_ms = _median(times[False]), _median(times[True])
    off_cpu, on_cpu = _median(cpu[False]), _median(cpu[True])
    return {
        "llm_prefix": "on",
        "llm_prefix_positions": prefix.positions,
        "llm_prefix_kib": round(prefix.nbytes() / 1024, 1),
        "llm_prefix_build_ms": round(prefix.build_ms, 1),
        "llm_prefill_off_ms": off_ms,
        "llm_prefill_on_ms": on_ms,
        "llm_prefill_ratio": round(on_ms / off_ms, 3) if on_ms and off_ms else None,
        "llm_prefill_off_cpu_ms": off_cpu,
        "llm_prefill_on_cpu_ms": on_cpu,
        "llm_prefill_cpu_ratio": round(on_cpu / off_cpu, 3) if on_cpu and off_cpu else None,
        "llm_prefill_off_runs_ms": [round(t, 1) for t in times[False]],
        "llm_prefill_on_runs_ms": [round(t, 1) for t in times[True]],
        "llm_prefill_max_abs_logp_diff": float(np.max(np.abs(logps[True] - logps[False]))),
    }


def llm_voice_report(engine: CosyVoiceSynthesizer, text: str, voice: str, repeats: int) -> dict[str, Any]:
    """`bench --llm-only --voice NAME`'s `voice_cache`: the LLM prefix fields
    above and the LLM's part of the first streaming chunk (prefill, then
    decoding up to the first chunk's tokens) without and with the prefix,
    alternated, seeded alike (their tokens compared)."""
    cond = engine.conditioning.build(SynthesisRequest(text=text, mode="zero_shot", voice=voice))
    ids = engine.frontend.prepare(text)[0].token_ids.tolist()
    report = llm_prefix_report(engine, cond, ids, repeats)
    prefix = engine.llm_prefix(cond, "zero_shot")
    hop = engine.bundle.streaming.token_hop_len + engine.bundle.flow.pre_lookahead_len
    config = engine.bundle.llm
    runs: dict[bool, list[float]] = {False: [], True: []}
    same = True
    for r in range(repeats):
        got: dict[bool, list[int]] = {}
        for on in (False, True):
            inp = LlmInput(text=ids, prompt_text=cond.prompt_text, prompt_speech=cond.prompt_speech,
                           prefix=prefix if on else None)
            sampler = TokenSampler.seeded(config.sampling, config.eos_token, r)
            t0 = time.perf_counter()
            got[on] = list(itertools.islice(engine.lm.generate(inp, sampler), hop))
            runs[on].append((time.perf_counter() - t0) * 1e3)
        same = same and got[False] == got[True]
    report.update({
        "llm_prefill_positions": 1 + len(cond.prompt_text) + len(ids) + 1 + len(cond.prompt_speech),
        "first_chunk_tokens": hop,
        "llm_first_chunk_off_ms": _median(runs[False]),
        "llm_first_chunk_on_ms": _median(runs[True]),
        "llm_first_chunk_off_runs_ms": [round(t, 1) for t in runs[False]],
        "llm_first_chunk_on_runs_ms": [round(t, 1) for t in runs[True]],
        "same_tokens_off_on": same,
    })
    return report


def inline_first_audio_ms(engine: CosyVoiceSynthesizer, text: str, voice: str, wav: Path,
                          repeats: int) -> dict[str, Any]:
    """The same recording and transcript sent with each request (`prompt`):
    not cacheable; each request extracts its features and runs the prompt
    through the flow in its first window."""
    transcript = PromptFeatures.load(engine.bundle.voices[voice]).transcript
    pcm, sr = load_audio(wav)
    prompt = PromptAudio(pcm=pcm, sample_rate=sr, text=transcript)
    firsts: list[float] = []
    for r in range(repeats + 1):  # the first run loads the feature sessions
        t0 = time.perf_counter()
        first = None
        for chunk in engine.synthesize(SynthesisRequest(text=text, mode="zero_shot", prompt=prompt, stream=True,
                                                        seed=r)):
            if first is None and chunk.pcm.size:
                first = (time.perf_counter() - t0) * 1e3
        if r and first is not None:
            firsts.append(first)
    return {"inline_first_audio_ms": _median(firsts), "inline_wav": str(wav),
            "inline_seconds": round(pcm.shape[0] / sr, 2)}
