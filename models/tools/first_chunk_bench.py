"""`cosyedge bench --first-chunk HOP:STEPS,..`: first-chunk settings against the
default. Per combination (first hop in speech tokens, Euler steps of the first
chunk; 0 = the default of either), the median time to first audio and the
streaming mel on the LLM's tokens for the text (seeded sampler): the first
chunk's mel against the same frames of the default settings' (mel SNR, mean
|difference|), against the same first hop at the bundle's steps (the steps'
share alone), and the largest difference of the later frames from the same
hop's (the caches are filled after the first chunk, so it is ~0)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from cosyedge_models.errors import CosyEdgeError
from cosyedge_models.synthesis.flow import FlowPrompt
from cosyedge_models.synthesis.streaming import ChunkSchedule
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer
from cosyedge_models.tools.bench_runs import bench_request, run_once
from cosyedge_models.tools.precision_compare import snr_db, speech_tokens


def parse_combos(value: str) -> list[tuple[int, int]]:
    """"15:6,25:10" -> [(15, 6), (25, 10)]; 0 keeps the default of either."""
    out = []
    for item in (x.strip() for x in value.split(",")):
        if not item:
            continue
        hop, sep, steps = item.partition(":")
        try:
            combo = (int(hop), int(steps) if sep else 0)
        except ValueError:
            raise CosyEdgeError(f"--first-chunk takes HOP:STEPS pairs (0: the default), got {item!r}") from None
        if min(combo) < 0:
            raise CosyEdgeError(f"--first-chunk takes integers >= 0, got {item!r}")
        out.append(combo)
    if not out:
        raise CosyEdgeError(f"--first-chunk takes HOP:STEPS pairs, got {value!r}")
    return out


def stream_chunks(engine: CosyVoiceSynthesizer, prompt: FlowPrompt, tokens: np.ndarray, first_hop: int | None,
                  first_steps: int | None) -> tuple[list[np.ndarray], int]:
    """The mel chunks of one streaming pass as the engine schedules them (its hop and final-chunk
    mode), and the estimator frames (summed over Euler steps) before the first chunk was out."""
    look = engine.bundle.flow.pre_lookahead_len
    schedule = ChunkSchedule(engine.bundle.streaming.token_hop_len, look, prompt_tokens=len(prompt.tokens),
                             first_hop=first_hop, hop_scale=engine.settings.hop_scale,
                             max_hop=engine.settings.max_hop_tokens)
    with engine.flow.stream(prompt, engine.settings.flow_final_chunk, engine.settings.flow_left_chunks,
                            first_steps=first_steps) as flow:
        mels = []
        first_work = -1
        while (chunk := schedule.next_chunk(len(tokens))) is not None:
            mels.append(flow.push(tokens[: chunk.end + look]))
            first_work = flow.work.frames if first_work < 0 else first_work
        mels.append(flow.finish(tokens))
    return mels, flow.work.frames if first_work < 0 else first_work


def _compare(reference: np.ndarray, test: np.ndarray) -> dict[str, float]:
    return {"mel_snr_db": round(snr_db(reference, test), 2), "mel_l1": round(float(np.abs(reference - test).mean()), 5)}


def first_chunk_sweep(engine: CosyVoiceSynthesizer, text: str, combos: list[tuple[int, int]], repeats: int,
                      voice: str | None = None) -> dict[str, Any]:
    """The combinations' first audio and mel against the default (the engine's own settings
    are swapped per combination, as the first-hop sweep does, and restored)."""
    original = engine.settings
    tokens = np.asarray(speech_tokens(engine, text, seed=0), np.int64)
    prompt = engine.conditioning.build(bench_request(text, True, 0, voice)).flow
    default = np.concatenate(stream_chunks(engine, prompt, tokens, original.first_hop_tokens,
                                           original.first_chunk_euler_steps)[0], axis=2)
    out: dict[str, Any] = {"n_timesteps": engine.bundle.flow.n_timesteps, "token_hop_len":
                           engine.bundle.streaming.token_hop_len, "speech_tokens": int(tokens.size),
                           "mel_abs_mean": round(float(np.abs(default).mean()), 4), "combinations": []}
    try:
        for hop, steps in [(0, 0), *combos]:
            settings = dataclasses.replace(original, first_hop_tokens=hop or original.first_hop_tokens,
                                           first_chunk_euler_steps=steps or original.first_chunk_euler_steps)
            engine.settings = settings
            engine.warm_vocoder()  # as an engine loaded with these settings (the first chunk's length)
            runs = [run_once(engine, text, stream=True, seed=r, voice=voice) for r in range(repeats)]
            firsts = sorted(r["first_audio_ms"] for r in runs if r["first_audio_ms"] is not None)
            mels, first_work = stream_chunks(engine, prompt, tokens, settings.first_hop_tokens,
                                             settings.first_chunk_euler_steps)
            same_hop, _ = stream_chunks(engine, prompt, tokens, settings.first_hop_tokens,
                                        original.first_chunk_euler_steps)
            n = mels[0].shape[2]
            later = np.concatenate(mels[1:], axis=2)
            later_ref = np.concatenate(same_hop[1:], axis=2)
            out["combinations"].append({
                "first_hop_tokens": settings.first_hop_tokens, "first_chunk_euler_steps": steps or None,
                "first_audio_ms": round(firsts[len(firsts) // 2], 1) if firsts else None,
                "first_audio_ms_runs": [round(f, 1) for f in firsts],
                "first_chunk_frames": n,
                # the first chunk's flow cost, deterministic (load-independent): estimator frames x steps
                "first_chunk_estimator_frames": first_work,
                "first_chunk_vs_default": _compare(default[:, :, :n], mels[0]),
                "first_chunk_vs_same_hop": _compare(same_hop[0], mels[0]),
                "later_max_abs_vs_same_hop": float(np.abs(later - later_ref).max()) if later.size else 0.0,
                "utterance_vs_default": _compare(default, np.concatenate(mels, axis=2)),
            })
    finally:
        engine.settings = original
    return out
