"""Home Assistant's TTS audio for the satellite, played through the daemon's
own playback: each audio-start … audio-stop becomes a Job with a playback
lane (daemon/serving/playback.py), so barge-in, ducking, half-duplex and the one
speaker order apply to it as to the daemon's own speech, and it shows in the
trace with route `satellite`. No synthesis, so it skips the scheduler."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from cosyedge_daemon.request.request import TtsRequest
from cosyedge_daemon.serving.jobs import Job
from cosyedge_daemon.serving.pipeline import Pipeline
from cosyedge_models.pcm import pcm16_to_float


class PlayedResponder:
    """Answers of a relayed job: `on_played` once it played (or was stopped)."""

    def __init__(self, on_played: Callable[[Job], None]) -> None:
        self.on_played = on_played

    def audio(self, job: Job, pcm: np.ndarray, sample_rate: int, seq: int, last: bool) -> None:
        pass  # output 'play' only: never published

    def done(self, job: Job, summary: dict[str, Any]) -> None:
        self.on_played(job)

    def error(self, job: Job, code: str, message: str) -> None:
        self.on_played(job)


def wyoming_pcm(data: bytes, width: int, channels: int) -> np.ndarray:
    """A Wyoming audio chunk as float32 mono (16-bit PCM only)."""
    if width != 2:
        raise ValueError(f"audio width {width} is not supported (16-bit PCM only)")
    return pcm16_to_float(data, channels)


class PlaybackRelay:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    @property
    def can_play(self) -> bool:
        return self.pipeline.sink is not None

    def open(self, responder: PlayedResponder) -> Job:
        now = time.monotonic()
        job = Job(TtsRequest(id=f"satellite-{uuid.uuid4().hex[:16]}", client_id=False, text="(Home Assistant audio)",
                             output="play", received_at=now), responder)
        job.route, job.route_reason, job.route_rule, job.engine_name = (
            "satellite", "Home Assistant's TTS audio", "satellite", "wyoming")
        job.started_at = now
        if self.can_play:
            self.pipeline.order.open(job)
        return job

    def put(self, job: Job, pcm: np.ndarray, sample_rate: int) -> bool:
        """Blocks while the lane is full (call it off the event loop)."""
        if not self.can_play or job.cancel.is_set():
            return False
        job.sample_rate = sample_rate
        job.samples_out += pcm.size
        job.chunks_out += 1
        limit = self.pipeline.settings.synth_ahead_chunks
        return self.pipeline.order.put_chunk(job, pcm, sample_rate, lambda: limit, lambda: None)

    def end(self, job: Job) -> None:
        self.pipeline.end_job(job)
