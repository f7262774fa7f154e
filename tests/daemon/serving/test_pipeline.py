"""The pipeline on its own (no MQTT): answers collected by a Responder that
records them, the engine is espeak-ng."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
from cosyedge_daemon.request.request import TtsRequest
from cosyedge_daemon.serving.answer import Completer
from cosyedge_daemon.serving.jobs import Job
from cosyedge_daemon.serving.pipeline import Pipeline
from cosyedge_daemon.serving.scheduler import Scheduler
from cosyedge_daemon.settings.schema import RoutingSettings, SchedulerSettings
from cosyedge_daemon.synthesizers.espeak import EspeakSynthesizer
from cosyedge_daemon.synthesizers.routing import Router, SynthesizerSet

from tests.support.components import require_binary
from tests.support.memory_sink import MemorySink


class Recorder:
    def __init__(self) -> None:
        self.answers: dict[str, tuple[str, Any]] = {}
        self.chunks: dict[str, list[int]] = {}
        self.event = threading.Event()

    def audio(self, job: Job, pcm: np.ndarray, sample_rate: int, seq: int, last: bool) -> None:
        self.chunks.setdefault(job.id, []).append(seq)

    def done(self, job: Job, summary: dict[str, Any]) -> None:
        self.answers[job.id] = ("done", summary)
        self.event.set()

    def error(self, job: Job, code: str, message: str) -> None:
        self.answers[job.id] = ("error", code)
        self.event.set()


class HintedEspeak(EspeakSynthesizer):
    """espeak-ng with the optional load hook the pipeline calls."""

    def __init__(self) -> None:
        super().__init__()
        self.levels: list[str] = []

    def set_load_level(self, level: str) -> None:
        self.levels.append(level)


def _pipeline(settings: SchedulerSettings, sink: MemorySink | None = None) -> tuple[Pipeline, HintedEspeak]:
    require_binary("espeak-ng", "apt-get install espeak-ng")
    engine = HintedEspeak()
    scheduler = Scheduler(settings)
    engines = SynthesizerSet(RoutingSettings())
    engines.slots["local"].swap(engine)
    pipeline = Pipeline(
        scheduler, Router(engines, RoutingSettings()), Completer(scheduler, None, False), settings, sink
    )
    return pipeline, engine


def _wait(rec: Recorder, n: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(rec.answers) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(rec.answers) == n, rec.answers


def test_degrades_under_load_then_recovers() -> None:
    settings = SchedulerSettings(degraded_queue_depth=2, synth_ahead_chunks=8, max_wait_ms=0)
    pipeline, engine = _pipeline(settings)
    rec = Recorder()
    assert pipeline._ahead_limit() == 8
    for n in range(4):
        pipeline.scheduler.submit(
            Job(TtsRequest(id=f"j{n}", text="Short one.", received_at=time.monotonic()), rec)
        )
    assert pipeline.scheduler.degraded() and pipeline._ahead_limit() == 2
    pipeline.start()
    try:
        _wait(rec, 4)
    finally:
        pipeline.stop()
    assert engine.levels[0] == "degraded" and engine.levels[-1] == "normal"
    assert [rec.answers[f"j{n}"][0] for n in range(4)] == ["done"] * 4
    assert rec.chunks["j0"] == [0]


def test_resamples_to_the_sink_rate() -> None:
    sink = MemorySink(sample_rate=16000, speed=8.0)
    sink.start()
    pipeline, _ = _pipeline(SchedulerSettings(max_wait_ms=0), sink)
    rec = Recorder()
    pipeline.start()
    try:
        pipeline.scheduler.submit(
            Job(
                TtsRequest(id="r", text="Resample me. Twice.", output="play", received_at=time.monotonic()),
                rec,
            )
        )
        _wait(rec, 1)
    finally:
        pipeline.stop()
        sink.close()
    kind, summary = rec.answers["r"]
    assert kind == "done" and summary["sample_rate"] == 24000
    assert abs(sink.played_seconds() - summary["audio_seconds"]) < 0.02  # 24 kHz in, 16 kHz played
