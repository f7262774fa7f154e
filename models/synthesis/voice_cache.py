"""Per-voice prompt caches: what a saved voice costs independent of the
request's text, computed once per engine (that is, per loaded bundle) and
reused by every streaming request with that voice.

What is cacheable, by stage (docs/voice-cache.md has the reasoning):

- Flow (streaming): CosyVoice 2's flow is chunk-causal and its start noise a
  fixed table, so the flow encoder's caches and, at every Euler step, the
  estimator's K/V and conv caches of the prompt's complete mask chunks come
  out the same whatever tokens follow. `build_flow_prefix` computes them
  once; `FlowStream(prefix=...)` starts after them, so the first chunk's
  window covers the prompt's unfinished chunk and the new frames instead of
  the whole prompt.
- LLM: upstream's input is [sos, prompt text, request text, task, prompt
  speech tokens]: the prompt speech comes after the request's text, so its
  K/V depend on the text and are not cacheable exactly; only sos + the
  prompt text are. For saved zero_shot voices their KV cache is kept here
  too (`LlmPrefix`, models/synthesis/llm_prefix.py), under the same key with
  part "llm", and counted in the same budget.
- Voices sent inline with one request (`prompt` in the request) and bounded
  left context (`flow_left_chunks >= 0`) are served uncached.

The cache is bounded in bytes (`SynthesisSettings.voice_cache_mb`), least
recently used first out; one build per voice at a time (concurrent first
requests wait for it rather than computing it twice).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import numpy as np
from cosyedge_models.backends.encoder_cache import EncoderCache, EncoderPrefix, HostEncoderCache
from cosyedge_models.backends.flow_cache import HostStepCache, PrefixRows, StepCache, read_only
from cosyedge_models.synthesis.conditioning import Conditioning
from cosyedge_models.synthesis.flow import FlowDecoder, FlowPrompt, commit_prompt, prompt_commit_frames
from cosyedge_models.synthesis.llm import SpeechTokenLM
from cosyedge_models.synthesis.llm_prefix import LlmPrefix, prompt_text_digest

log = logging.getLogger(__name__)

MIB = 1 << 20


class CacheEntry(Protocol):
    """What the cache keeps per voice and part: its size counts against the budget."""

    @property
    def build_ms(self) -> float: ...

    def nbytes(self) -> int: ...

    def describe(self) -> str: ...

    def retire(self) -> None:
        """Dropped from the cache: free its device copies once no request reads them."""
        ...


Entry = TypeVar("Entry", bound=CacheEntry)


@dataclass(frozen=True)
class FlowPrefix:
    """A streaming flow's state after a voice's complete prompt chunks: the
    frames committed, the encoder caches and, per Euler step, the estimator's
    K/V rows [committed, *row] and conv history. Read-only once built."""

    committed: int  # mel frames (a whole number of mask chunks)
    encoder: EncoderPrefix
    step_kv: tuple[PrefixRows, ...]
    step_conv: tuple[np.ndarray, ...]
    build_ms: float = 0.0

    def nbytes(self) -> int:
        arrays = (*(r.host for r in self.step_kv), *self.step_conv)
        return self.encoder.nbytes() + sum(a.nbytes for a in arrays)

    def describe(self) -> str:
        return f"flow prefix of {self.committed} mel frames"

    def device_nbytes(self) -> int:
        """The copies on devices (GPU backends): as large as the K/V rows, per device."""
        return self.encoder.device_nbytes() + sum(r.device_nbytes() for r in self.step_kv)

    def retire(self) -> None:
        self.encoder.retire()
        for rows in self.step_kv:
            rows.retire()

    def apply(self, caches: Sequence[StepCache], encoder: EncoderCache | None) -> EncoderCache:
        """Seed one request's fresh caches with this prefix (the estimator rows
        are shared read-only on the host; on a device, copied from the voice's
        copy there; the encoder's as its cache keeps them)."""
        if len(caches) != len(self.step_kv) or encoder is None:
            raise ValueError(f"prefix of {len(self.step_kv)} Euler steps for a stream of {len(caches)}")
        for cache, kv, conv in zip(caches, self.step_kv, self.step_conv, strict=True):
            cache.preload(kv, conv)
        encoder.preload(self.encoder)
        return encoder


def _owned(a: np.ndarray) -> np.ndarray:
    """`a` without the spare capacity of the buffer it may be a view of."""
    base = a.base
    return a.copy() if isinstance(base, np.ndarray) and base.nbytes > a.nbytes else a


def build_flow_prefix(decoder: FlowDecoder, prompt: FlowPrompt) -> FlowPrefix | None:
    """The voice's flow prefix (cosyedge_models.synthesis.flow.commit_prompt into host caches,
    whatever the backend: kept once, seeded into each request's caches), or
    None when its prompt has no complete chunk."""
    t0 = time.perf_counter()
    if prompt_commit_frames(decoder, prompt.tokens.size) == 0:
        return None
    encoder = HostEncoderCache(decoder.encoder, decoder.encoder_spec)
    caches = [HostStepCache(decoder.estimator, decoder.cache_spec()) for _ in range(decoder.config.n_timesteps)]
    commit = commit_prompt(decoder, prompt, encoder, caches)
    return FlowPrefix(
        committed=commit,
        encoder=encoder.snapshot(),
        step_kv=tuple(PrefixRows(_owned(c.kv)) for c in caches), step_conv=tuple(read_only(c.conv) for c in caches),
        build_ms=(time.perf_counter() - t0) * 1e3,
    )


def bundle_identity(root: str, manifest_text: str, precision: str) -> str:
    """What a cached prefix is valid for: the bundle's place, its manifest (its
    stage files and voices) and the precision loaded."""
    digest = hashlib.sha256(manifest_text.encode()).hexdigest()[:16]
    return f"{root}@{digest}/{precision}"


@dataclass
class VoiceCacheStats:
    hits: int = 0
    builds: int = 0
    too_big: int = 0  # prefixes larger than the whole budget (served uncached)
    evictions: int = 0


Key = tuple[str, str, str, str]  # bundle identity, voice, digest of what the entry is built from, part


class VoiceCache:
    """Per-voice prefixes (part "flow": FlowPrefix; "llm": LlmPrefix) keyed by
    (bundle identity, voice name, digest of the voice features they are
    built from, part), bounded together to `max_bytes` (least recently used
    evicted). Thread-safe."""

    def __init__(self, max_bytes: int, bundle_id: str) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bundle_id = bundle_id
        self.stats = VoiceCacheStats()
        self._entries: OrderedDict[Key, CacheEntry | None] = OrderedDict()
        self._building: dict[Key, threading.Lock] = {}
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(p.nbytes() for p in self._entries.values() if p is not None)

    def part_nbytes(self, part: str) -> int:
        with self._lock:
            return sum(p.nbytes() for k, p in self._entries.items() if p is not None and k[3] == part)

    def key(self, voice: str, voice_digest: str, part: str = "flow") -> Key:
        return (self.bundle_id, voice, voice_digest, part)

    def get(self, voice: str, voice_digest: str, build: Callable[[], Entry | None], part: str = "flow") -> Entry | None:
        """The voice's prefix of `part`, built on first use (None: nothing
        cacheable, or it does not fit the budget)."""
        if self.max_bytes == 0:
            return None
        key = self.key(voice, voice_digest, part)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return cast("Entry | None", self._entries[key])
            building = self._building.setdefault(key, threading.Lock())
        with building:  # one build per voice; the others wait for it
            with self._lock:
                if key in self._entries:
                    self.stats.hits += 1
                    return cast("Entry | None", self._entries[key])
            prefix = build()
            with self._lock:
                self._building.pop(key, None)
                self.stats.builds += 1
                if prefix is not None and prefix.nbytes() > self.max_bytes:
                    self.stats.too_big += 1
                    log.warning("voice %r: its prompt cache needs %.0f MiB, more than voice_cache_mb (%.0f MiB); "
                                "served uncached", voice, prefix.nbytes() / MIB, self.max_bytes / MIB)
                    prefix = None
                self._entries[key] = prefix  # None is remembered too: no rebuild per request
                self._evict()
                if prefix is not None:
                    log.info("voice %r: prompt cache: %s, %.2f MiB, built in %.0f ms", voice, prefix.describe(),
                             prefix.nbytes() / MIB, prefix.build_ms)
            return prefix

    def _evict(self) -> None:
        total = sum(p.nbytes() for p in self._entries.values() if p is not None)
        while total > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            if old is not None:
                total -= old.nbytes()
                self.stats.evictions += 1
                old.retire()

    def clear(self) -> None:
        with self._lock:
            for entry in self._entries.values():
                if entry is not None:
                    entry.retire()
            self._entries.clear()


def flow_digest(prompt: FlowPrompt) -> str:
    """The voice's content (tokens, mel, embedding): a voice file replaced
    under the same name gets a new key."""
    h = hashlib.sha256()
    for a in (prompt.tokens, prompt.feat, prompt.embedding):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def saved_voice_prefix(cache: VoiceCache, decoder: FlowDecoder, cond: Conditioning, enabled: bool,
                       left_chunks: int) -> FlowPrefix | None:
    """The saved voice's streaming flow prefix (built on first use), or None
    where it does not apply: a prompt sent with the request, no prompt (sft),
    the cache off, or a bounded left context."""
    if cond.voice is None or not cond.flow.tokens.size or not enabled or left_chunks >= 0:
        return None
    flow = cond.flow
    return cache.get(cond.voice, flow_digest(flow), lambda: build_flow_prefix(decoder, flow))


def saved_voice_llm_prefix(cache: VoiceCache, lm: SpeechTokenLM, cond: Conditioning, mode: str,
                           enabled: bool) -> LlmPrefix | None:
    """The saved zero_shot voice's LLM prefix (sos + transcript; built on first
    use), or None where it does not apply: another mode, a prompt sent with
    the request, the cache off, or a bundle whose llm_decode takes one position."""
    if mode != "zero_shot" or cond.voice is None or not cond.prompt_text or not enabled or not lm.takes_prefix:
        return None
    text = cond.prompt_text
    return cache.get(cond.voice, prompt_text_digest(text), lambda: lm.build_prefix(text), part="llm")
