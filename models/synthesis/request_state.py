"""One request's state inside the engine (sampler, noise, stage times,
cancellation) and the per-chunk LLM spans of its timeline."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from cosyedge_models.synthesis.api import StageEvent, StageTimes, TimelineStage
from cosyedge_models.synthesis.llm import LlmStats
from cosyedge_models.synthesis.sampling import TokenSampler
from cosyedge_models.synthesis.token_stream import LlmEnd, TimedToken
from cosyedge_models.synthesis.vocoder import NoiseSource


@dataclass
class RequestState:
    sampler: TokenSampler
    noise: NoiseSource
    times: StageTimes
    started: float
    cancel: threading.Event | None
    priority: int = 0
    # a streamed request's first chunk goes first until its first audio (an offline one served as a
    # stream has no first audio to hurry)
    first_audio: bool = True
    index: int = 0
    tokens_before: int = 0  # speech tokens of the request's earlier segments
    audio_sent_s: float = 0.0  # audio handed to the caller so far (the flow gather's queued audio)
    # Written by the LLM producer thread while stages overlap; the consumer reads
    # it for the running totals in each chunk (exact once the segment's LLM ended).
    llm: LlmStats = field(default_factory=LlmStats)

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def event(self, stage: TimelineStage, start: float, end: float) -> None:
        """Timeline entry for the chunk about to be yielded (perf_counter times)."""
        self.times.timeline.append(StageEvent(stage, self.index, (start - self.started) * 1e3,
                                              (end - self.started) * 1e3))


class LlmSpans:
    """Per-chunk LLM spans from timed tokens: a chunk's span runs from the start
    of the first token after the previous chunk's to the end of the token that
    completed it (a token that completes several chunks gives only the first a span)."""

    def __init__(self) -> None:
        self._start: float | None = None

    def add(self, state: RequestState, token: TimedToken) -> None:
        if self._start is None:
            self._start = token.start
        if state.times.first_token_ms is None:  # the request's first speech token
            state.times.first_token_ms = (token.end - state.started) * 1e3

    def take(self, state: RequestState, until: float) -> None:
        if self._start is not None:
            state.event("llm", self._start, until)
        self._start = None

    def finish(self, state: RequestState, end: LlmEnd | None) -> None:
        if end is not None:
            state.event("llm", self._start if self._start is not None else end.start, end.end)
        self._start = None
