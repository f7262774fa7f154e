"""A request in flight: its cancel flag, why it was stopped, where it went,
and the timings that end up in `done` and the trace log line."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from cosyedge_daemon.request.request import TtsRequest

if TYPE_CHECKING:
    from cosyedge_daemon.synthesizers.routing import RouteDecision

# Why a job was stopped before its end. The first three end with `done`
# (the audio so far was delivered), the others with `error`.
DONE_STOPS = ("interrupted", "preempted")
ERROR_STOPS = ("cancelled", "deadline_exceeded", "shutting_down")


class Responder(Protocol):
    """Where a job's answers go (native topics, Hermes topics)."""

    def audio(self, job: Job, pcm: np.ndarray, sample_rate: int, seq: int, last: bool) -> None: ...

    def done(self, job: Job, summary: dict[str, Any]) -> None: ...

    def error(self, job: Job, code: str, message: str) -> None: ...


@dataclass
class Job:
    request: TtsRequest
    responder: Responder
    cancel: threading.Event = field(default_factory=threading.Event)
    stop_reason: str | None = None
    decision: RouteDecision | None = None  # the route, decided once when the request was accepted
    route: str | None = None
    route_reason: str = ""
    route_rule: str = ""  # the routing rule's stable label (metrics)
    engine_name: str = ""
    sample_rate: int = 0
    samples_out: int = 0
    chunks_out: int = 0
    started_at: float | None = None  # monotonic: taken off the queue
    first_audio_at: float | None = None  # monotonic: first audio written or published
    synth_done_at: float | None = None
    playback_started_at: float | None = None
    stage_times: dict[str, Any] = field(default_factory=dict)
    _terminal_lock: threading.Lock = field(default_factory=threading.Lock)
    _terminal_sent: bool = False

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def plays(self) -> bool:
        return self.request.output in ("play", "both")

    @property
    def publishes(self) -> bool:
        return self.request.output in ("publish", "both")

    @property
    def deadline_at(self) -> float | None:
        d = self.request.deadline_ms
        return None if d is None else self.request.received_at + d / 1000.0

    def stop(self, reason: str) -> bool:
        """Ask the job to end early; the first reason wins. False if already stopping."""
        with self._terminal_lock:
            if self.stop_reason is not None or self._terminal_sent:
                return False
            self.stop_reason = reason
        self.cancel.set()
        return True

    def claim_terminal(self) -> bool:
        """True exactly once: whoever gets it sends the one done/error."""
        with self._terminal_lock:
            if self._terminal_sent:
                return False
            self._terminal_sent = True
            return True

    @property
    def finished(self) -> bool:
        return self._terminal_sent

    def audio_seconds(self) -> float:
        return self.samples_out / self.sample_rate if self.sample_rate else 0.0

    def mark_audio_out(self, now: float | None = None) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic() if now is None else now

    def summary(self, reason: str, now: float | None = None) -> dict[str, Any]:
        """The `done` payload (also the trace log line)."""
        now = time.monotonic() if now is None else now
        received = self.request.received_at
        started = self.started_at if self.started_at is not None else now
        synth_s = (self.synth_done_at or now) - started
        audio_s = self.audio_seconds()

        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1000.0, 2)

        st = self.stage_times
        trace = {
            "queued_ms": ms(received, started),
            "frontend_ms": st.get("frontend_ms", 0.0),
            "llm_ms": st.get("llm_ms", 0.0),
            "flow_ms": st.get("flow_ms", 0.0),
            "vocoder_ms": st.get("vocoder_ms", 0.0),
            "engine_first_audio_ms": st.get("first_audio_ms"),
            "first_audio_ms": ms(received, self.first_audio_at),
            "playback_ms": ms(self.playback_started_at, now) if self.plays else None,
        }
        return {
            "id": self.id,
            "route": self.route,
            "route_reason": self.route_reason,
            "route_rule": self.route_rule,
            "engine": self.engine_name,
            "reason": reason,
            "output": self.request.output,
            "sample_rate": self.sample_rate,
            "chunks": self.chunks_out,
            "audio_seconds": round(audio_s, 3),
            "first_audio_ms": trace["first_audio_ms"],
            "rtf": round(synth_s / audio_s, 4) if audio_s > 0 else None,
            "total_ms": ms(received, now),
            "trace": trace,
        }
