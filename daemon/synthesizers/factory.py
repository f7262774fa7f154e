"""Creating the engines the daemon serves with: the local engine (a
CosyVoice bundle through `cosyedge_models.synthesis.synthesizer.load_synthesizer`, imported lazily, or
espeak-ng when `[tts] engine = "espeak-ng"`) and the espeak-ng fallback."""

from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

from cosyedge_daemon.settings.schema import FallbackSettings, Settings
from cosyedge_daemon.settings.tts import TtsSettings
from cosyedge_daemon.synthesizers.espeak import EspeakSynthesizer
from cosyedge_models.errors import RequestError, SynthesisError
from cosyedge_models.synthesis.api import ServedSynthesizer

log = logging.getLogger(__name__)


def load_local_synthesizer(settings: Settings, bundle: str | None = None) -> ServedSynthesizer:
    tts, fb = settings.tts, settings.fallback
    if tts.engine == "espeak-ng":
        return EspeakSynthesizer(fb.voice, fb.rate_wpm, fb.sample_rate_hz, fb.binary)
    if not (bundle or tts.bundle):
        # `cosyedge run` resolves the default (tiny) bundle before the service starts.
        raise SynthesisError("no bundle configured: set [tts] bundle or --bundle")
    path = Path(bundle or tts.bundle)
    # lazily: the CosyVoice runtime (onnxruntime, tokenizers)
    from cosyedge_models.batching.policy import BatchSettings
    from cosyedge_models.synthesis.settings import SynthesisSettings
    from cosyedge_models.synthesis.synthesizer import load_synthesizer

    batching = BatchSettings(max_batch_size=tts.llm_max_batch_size, max_queue_delay_ms=tts.llm_max_queue_delay_ms) \
        if tts.llm_max_batch_size else None
    flow_batching = BatchSettings(max_batch_size=tts.flow_max_batch_size,
                                  max_queue_delay_ms=tts.flow_max_queue_delay_ms) if tts.flow_max_batch_size else None
    # The keys [tts] and SynthesisSettings share (backend, max_text_chars, flow_final_chunk, flow_left_chunks,
    # voice_cache_mb, cpu_memory_arena, ...) pass as they are; only those that differ are translated here.
    shared = {f.name for f in fields(SynthesisSettings)} & {f.name for f in fields(TtsSettings)}
    values: dict[str, Any] = {name: getattr(tts, name) for name in shared}
    values.update(
        batching=batching, flow_batching=flow_batching,
        overlap_stages={"on": True, "off": False}.get(tts.overlap_stages),  # auto: None
        offline_as_stream={"on": True, "off": False}.get(tts.offline_as_stream),
        vocoder_pad_final={"on": True, "off": False}.get(tts.vocoder_pad_final),
        first_hop_tokens=tts.first_hop_tokens or None,  # 0: upstream's aligned hop
        first_chunk_euler_steps=tts.first_chunk_euler_steps or None,  # 0: the bundle's n_timesteps
        hop_scale=tts.stream_hop_scale,
        max_hop_tokens=tts.stream_max_hop_tokens or None,  # 0: 4 x the hop (upstream)
    )
    engine = load_synthesizer(path, settings=SynthesisSettings(**values))
    log.info("loaded %s from %s (%d Hz)", engine.name, path, engine.sample_rate)
    voice = tts.default_voice or engine.bundle.default_voice
    if voice:  # its prompt caches now, and its flow prefix in the batched lanes: its first requests start sooner
        try:
            lanes = engine.prepare_voice(voice)
        except RequestError as exc:  # an unknown default voice: requests that name none get the same answer
            log.warning("default voice %r not prepared: %s", voice, exc)
        else:
            log.info("default voice %r prepared (%d batched flow lanes seeded)", voice, lanes)
    return engine


def make_fallback(settings: FallbackSettings, sample_rate: int | None) -> ServedSynthesizer | None:
    """The espeak-ng fallback at the local engine's rate, or None (disabled or
    not installed: logged, the daemon then answers synthesizer_unavailable)."""
    if not settings.enabled:
        return None
    try:
        return EspeakSynthesizer(
            settings.voice, settings.rate_wpm, sample_rate or settings.sample_rate_hz, settings.binary
        )
    except SynthesisError as exc:
        log.warning("no fallback voice: %s", exc)
        return None
