"""The engine interface that the daemon, the cloud bridge and the benchmarks
use. Everything above the engine depends on these types only, so the same
code runs on onnxruntime (CPU here), TensorRT (the board) or espeak-ng (the
fallback voice)."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
from cosyedge_models.synthesis.modes import Mode


@dataclass(frozen=True)
class PromptAudio:
    """A voice reference given with the request (zero-shot cloning)."""

    pcm: np.ndarray  # float32 mono in [-1, 1]
    sample_rate: int
    text: str = ""  # transcript; required for zero_shot, unused for cross_lingual


# The speaking rate a request may ask for, as a factor of the normal rate: the one
# range the daemon's front ends, the cloud wire and the synthesizers all check.
SPEED_MIN, SPEED_MAX = 0.5, 2.0
# The longest text a request may carry, in characters: the one default of the daemon's
# `[tts] max_text_chars` (which it passes on to its synthesizer), of a synthesizer's own
# `SynthesisSettings.max_text_chars` and of the cloud bridge's `[limits] max_text_chars`.
MAX_TEXT_CHARS = 4000


@dataclass(frozen=True)
class SynthesisRequest:
    text: str
    mode: Mode = "sft"
    voice: str | None = None  # a voice of the bundle; None: the bundle's default
    instruct_text: str | None = None
    prompt: PromptAudio | None = None
    stream: bool = True
    seed: int | None = None  # None: a fresh random seed
    speed: float = 1.0  # SPEED_MIN..SPEED_MAX
    priority: int = 0  # higher joins a full LLM batch first (the daemon's request priority)


# "hold": a request's first-audio hold on the GPU graph thread (its first chunk's flow and
# vocoder, while the captured LLM steps wait: models/backends/graph_thread.py)
TimelineStage = Literal["llm", "flow", "vocoder", "hold"]


@dataclass(frozen=True)
class StageEvent:
    """One stage's work for one audio chunk, in milliseconds since the request
    started. `llm` covers the tokens that chunk waited for (from the first of
    them being started to the last one sampled), so with stage overlap the LLM
    event of chunk n+1 overlaps the flow and vocoder events of chunk n."""

    stage: TimelineStage
    chunk: int  # AudioChunk.index the work belongs to
    start_ms: float
    end_ms: float

    def as_dict(self) -> dict[str, str | int | float]:
        return {"stage": self.stage, "chunk": self.chunk,
                "start_ms": round(self.start_ms, 2), "end_ms": round(self.end_ms, 2)}


@dataclass
class StageTimes:
    """Wall time spent per stage for one request, in milliseconds, and the
    per-chunk timeline of the stages (kept out of `as_dict`, which goes into
    every MQTT `done` payload; see `timeline_dicts`)."""

    frontend_ms: float = 0.0
    llm_ms: float = 0.0
    flow_ms: float = 0.0
    vocoder_ms: float = 0.0
    first_audio_ms: float | None = None
    llm_tokens: int = 0
    timeline: list[StageEvent] = field(default_factory=list)
    # the first speech token sampled (its prompt's prefill and first step done), ms after the request
    # started: with the LLM span's start, where a stream's first chunk waited (kept out of `as_dict`)
    first_token_ms: float | None = None
    flow_frames: int = 0  # mel frames the CFM estimator evaluated, summed over Euler steps (a work count)
    llm_batch_max: int = 0  # the most requests in one batched LLM decode step with this one (0: unbatched)

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "frontend_ms": round(self.frontend_ms, 2),
            "llm_ms": round(self.llm_ms, 2),
            "flow_ms": round(self.flow_ms, 2),
            "vocoder_ms": round(self.vocoder_ms, 2),
            "first_audio_ms": None if self.first_audio_ms is None else round(self.first_audio_ms, 2),
            "llm_tokens": self.llm_tokens,
            "flow_frames": self.flow_frames,
            "llm_batch_max": self.llm_batch_max,
        }

    def timeline_dicts(self) -> list[dict[str, str | int | float]]:
        return [e.as_dict() for e in sorted(self.timeline, key=lambda e: (e.start_ms, e.end_ms))]


@dataclass
class AudioChunk:
    pcm: np.ndarray  # float32 mono in [-1, 1]
    sample_rate: int
    index: int  # 0, 1, 2, ... within the request
    last: bool
    times: StageTimes = field(default_factory=StageTimes)  # cumulative up to this chunk


class Synthesizer(Protocol):
    """A speech synthesizer. `synthesize` may be called from several threads
    at once; each call carries its own streaming state."""

    name: str  # "cosyvoice-ort", "cosyvoice-trt", "espeak-ng", ...
    sample_rate: int

    def voices(self) -> list[str]: ...

    def modes(self) -> tuple[Mode, ...]: ...

    def validate(self, request: SynthesisRequest) -> None:
        """Raise RequestError (code and message) if the request cannot be served."""
        ...

    def synthesize(
        self, request: SynthesisRequest, cancel: threading.Event | None = None
    ) -> Iterator[AudioChunk]:
        """Yield audio chunks as they are ready; the last has last=True. Stops
        early (without error) when `cancel` is set."""
        ...

    def close(self) -> None: ...


LoadLevel = Literal["normal", "degraded"]


class SynthesizeFn(Protocol):
    """`Synthesizer.synthesize`'s call shape (what `ServedSynthesizer.for_job` returns)."""

    def __call__(self, request: SynthesisRequest, cancel: threading.Event | None = None) -> Iterator[AudioChunk]: ...


class ServedSynthesizer(Synthesizer, Protocol):
    """What the daemon may ask of an engine it serves with, besides synthesis.
    Every engine the daemon uses implements it (the CosyVoice engine, the
    espeak-ng fallback, the cloud engine); `SynthesizerDefaults` gives the neutral
    answers to an engine with nothing more to say."""

    def available(self) -> bool:
        """Whether it can take a request now (the cloud: connected, its bridge
        link up); the router does not send a request to an engine that says no."""
        ...

    def set_load_level(self, level: LoadLevel) -> None:
        """The daemon's load hint before each request: under "degraded" load an
        engine may cut its batching delay."""
        ...

    def for_job(self, job_id: str, deadline_at: float | None, *, validated: bool = False) -> SynthesizeFn:
        """`synthesize` for one daemon job (the cloud carries the job's id and
        deadline, a `time.monotonic()` time, along). `validated`: this
        synthesizer's `validate` passed on the very request already (the
        daemon validates once, at admission), so it need not run again."""
        ...

    def concurrent_streams(self) -> int | None:
        """How many requests it serves at once before the next waits inside it (the GPU flow's
        stream seats); None: no bound of its own. The daemon runs no more local requests at once,
        so that the rest wait in its queue, where the router's load rules see them."""
        ...


class SynthesizerDefaults(ABC):
    """The neutral `ServedSynthesizer` answers: always available, no use for the
    load hint, the same `synthesize` for every job."""

    @abstractmethod
    def synthesize(
        self, request: SynthesisRequest, cancel: threading.Event | None = None
    ) -> Iterator[AudioChunk]: ...

    def available(self) -> bool:
        return True

    def set_load_level(self, level: LoadLevel) -> None:
        return None

    def for_job(self, job_id: str, deadline_at: float | None, *, validated: bool = False) -> SynthesizeFn:
        return self.synthesize

    def concurrent_streams(self) -> int | None:
        return None
