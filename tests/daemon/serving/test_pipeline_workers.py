"""Several synthesis workers on one engine (no MQTT): requests overlap in
synthesis, played requests still play one at a time in the scheduler's
order with a bounded lead, a barge-in moves on to the next request, a
failing request leaves its worker serving, priorities reach the engine.
The engine is tests/support/fake_synthesizer.py; the tests wait on events and
state, never on durations."""

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
from cosyedge_daemon.synthesizers.routing import Router, SynthesizerSet

from tests.support.fake_synthesizer import FakeSynthesizer
from tests.support.memory_sink import MemorySink
from tests.support.waiting import wait_until

LEVELS = {"A": 0.1, "B": 0.2, "C": 0.3}


class Answers:
    """A Responder that keeps the answers in the order they were sent."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[str, Any]] = {}
        self.order: list[str] = []
        self.audio_chunks: dict[str, int] = {}
        self._cond = threading.Condition()

    def audio(self, job: Job, pcm: np.ndarray, sample_rate: int, seq: int, last: bool) -> None:
        self.audio_chunks[job.id] = self.audio_chunks.get(job.id, 0) + 1

    def done(self, job: Job, summary: dict[str, Any]) -> None:
        self._answer(job.id, "done", summary["reason"])

    def error(self, job: Job, code: str, message: str) -> None:
        self._answer(job.id, "error", code)

    def _answer(self, rid: str, kind: str, what: Any) -> None:
        with self._cond:
            self.answers[rid] = (kind, what)
            self.order.append(rid)
            self._cond.notify_all()

    def wait(self, n: int, timeout_s: float = 20.0) -> None:
        with self._cond:
            self._cond.wait_for(lambda: len(self.answers) >= n, timeout_s)
        assert len(self.answers) >= n, self.answers


def make(engine: FakeSynthesizer, workers: int, sink: MemorySink | None = None, **sched: Any) -> Pipeline:
    settings = SchedulerSettings(max_wait_ms=0, **sched)
    scheduler = Scheduler(settings, concurrency=workers)
    engines = SynthesizerSet(RoutingSettings())
    engines.slots["local"].swap(engine)
    router = Router(engines, RoutingSettings())
    return Pipeline(scheduler, router, Completer(scheduler, None, False), settings, sink, workers=workers)


def submit(p: Pipeline, rec: Answers, rid: str, text: str | None = None, output: str = "play",
           priority: int = 0) -> Job:
    job = Job(TtsRequest(id=rid, text=text or rid, output=output, priority=priority,  # type: ignore[arg-type]
                         received_at=time.monotonic()), rec)
    p.scheduler.submit(job)
    return job


def played_runs(sink: MemorySink) -> list[tuple[float, int]]:
    """(level, samples) per run of equal level, in playing order."""
    runs: list[tuple[float, int]] = []
    for block in sink.played:
        if not block.size:
            continue
        level = round(float(block.mean()), 2)
        if runs and runs[-1][0] == level:
            runs[-1] = (level, runs[-1][1] + block.size)
        else:
            runs.append((level, block.size))
    return runs


def test_two_workers_synthesize_two_requests_at_once() -> None:
    # The engine lets a request through only once both are inside it: this completes only with overlap.
    engine = FakeSynthesizer(together=2)
    p, rec = make(engine, workers=2), Answers()
    submit(p, rec, "one", output="publish")
    submit(p, rec, "two", output="publish")
    p.start()
    try:
        rec.wait(2)
    finally:
        p.stop()
    assert rec.answers == {"one": ("done", "completed"), "two": ("done", "completed")}
    assert engine.max_active == 2 and rec.audio_chunks == {"one": 3, "two": 3}


def test_one_worker_synthesizes_one_at_a_time() -> None:
    engine = FakeSynthesizer()
    p, rec = make(engine, workers=1), Answers()
    for rid in ("one", "two", "three"):
        submit(p, rec, rid, output="publish")
    p.start()
    try:
        rec.wait(3)
    finally:
        p.stop()
    assert engine.max_active == 1 and rec.order == ["one", "two", "three"]


def test_played_requests_play_one_at_a_time_in_scheduler_order() -> None:
    sink = MemorySink(speed=50.0)
    sink.start()
    engine = FakeSynthesizer(chunks=4, levels=LEVELS, together=3)  # all three are synthesized at once
    p, rec = make(engine, workers=3, sink=sink), Answers()
    submit(p, rec, "A")
    submit(p, rec, "B")
    submit(p, rec, "C", priority=5)  # the scheduler's order: C, A, B
    p.start()
    try:
        rec.wait(3)
    finally:
        p.stop()
        sink.close()
    assert engine.max_active == 3
    per_request = 4 * engine.chunk_samples
    assert played_runs(sink) == [(0.3, per_request), (0.1, per_request), (0.2, per_request)]  # never interleaved
    assert rec.order == ["C", "A", "B"] and {k for k, _ in rec.answers.values()} == {"done"}


def test_a_request_synthesized_ahead_waits_with_a_bounded_lead() -> None:
    sink = MemorySink()  # not started: the speaker holds what it got, so "A" stays on it
    engine = FakeSynthesizer(chunks=6, chunk_s=0.1, levels=LEVELS)
    p, rec = make(engine, workers=2, sink=sink, synth_ahead_chunks=2), Answers()
    submit(p, rec, "A")
    b = submit(p, rec, "B")
    p.start()
    try:
        wait_until(lambda: "B" in engine.seen and engine.seen["B"].produced == 3 and p.order.queued(b) == 2)
        # Both workers go round their wait loop (heartbeats) while B's lead stays at the bound.
        before = dict(p.heartbeats)
        wait_until(lambda: all(p.heartbeats[n] > before[n] + 0.3 for n in ("synthesis-1", "synthesis-2")))
        assert engine.seen["B"].produced == 3 and p.order.queued(b) == 2
        assert not engine.seen["B"].left.is_set() and not rec.answers
        assert p.workers_alive(stall_s=5.0) == {"synthesis-1": True, "synthesis-2": True, "playback": True}
        sink.start()
        rec.wait(2)
    finally:
        p.stop()
        sink.close()
    per_request = 6 * engine.chunk_samples
    assert played_runs(sink) == [(0.1, per_request), (0.2, per_request)]
    assert rec.order == ["A", "B"]


def test_published_requests_never_wait_for_the_speaker() -> None:
    sink = MemorySink()  # not started: "A" holds the speaker
    engine = FakeSynthesizer(chunks=6, chunk_s=0.1, levels=LEVELS)
    p, rec = make(engine, workers=2, sink=sink, synth_ahead_chunks=1), Answers()
    submit(p, rec, "A")
    submit(p, rec, "P1", output="publish")
    submit(p, rec, "P2", output="publish")
    p.start()
    try:
        rec.wait(2)  # both published while "A" is still on the speaker
        # two workers: the one that handed "A" to the speaker may take P2 while the other makes P1
        assert sorted(rec.order) == ["P1", "P2"] and rec.audio_chunks == {"P1": 6, "P2": 6}
        # "A" reaches the speaker and stays there (the sink is not started); on a loaded machine its
        # hand-over can come after the published answers
        wait_until(lambda: p.playing_job is not None and p.playing_job.id == "A", 5.0)
        sink.start()
        rec.wait(3)
    finally:
        p.stop()
        sink.close()
    assert rec.answers["A"] == ("done", "completed")


def test_barge_in_stops_the_playing_request_and_the_next_one_plays() -> None:
    sink = MemorySink(speed=4.0)
    sink.start()
    engine = FakeSynthesizer(chunks=10, chunk_s=0.1, levels=LEVELS)
    p, rec = make(engine, workers=2, sink=sink), Answers()
    a = submit(p, rec, "A")
    submit(p, rec, "B")
    p.start()
    try:
        wait_until(lambda: p.playing_job is a and sink.played_seconds() > 0)
        assert p.interrupt_playing() is a
        rec.wait(2)
    finally:
        p.stop()
        sink.close()
    assert rec.answers == {"A": ("done", "interrupted"), "B": ("done", "completed")}
    runs = played_runs(sink)
    assert [level for level, _ in runs] == [0.1, 0.2]
    assert runs[0][1] < 10 * engine.chunk_samples and runs[1][1] == 10 * engine.chunk_samples


def test_stopping_requests_waiting_for_the_speaker_answers_them_at_once() -> None:
    sink = MemorySink()  # not started: "A" holds the speaker
    engine = FakeSynthesizer(chunks=6, chunk_s=0.1, levels=LEVELS)
    p, rec = make(engine, workers=3, sink=sink, synth_ahead_chunks=8), Answers()
    submit(p, rec, "A")
    b = submit(p, rec, "B")
    c = submit(p, rec, "C", text="C HOLD")  # still in synthesis when stopped
    p.start()
    try:
        wait_until(lambda: engine.seen.get("B") is not None and engine.seen["B"].left.is_set()
                   and "C HOLD" in engine.seen)
        assert p.stop_job(b, "cancelled") and p.stop_job(c, "cancelled")
        rec.wait(2)  # while "A" still holds the speaker
        assert rec.answers == {"B": ("error", "cancelled"), "C": ("error", "cancelled")}
        assert engine.seen["C HOLD"].left.wait(5) and engine.seen["C HOLD"].cancelled
        sink.start()
        rec.wait(3)
    finally:
        p.stop()
        sink.close()
    assert rec.answers["A"] == ("done", "completed")
    assert [level for level, _ in played_runs(sink)] == [0.1]


def test_a_failing_request_does_not_kill_its_worker() -> None:
    engine = FakeSynthesizer()
    p, rec = make(engine, workers=2), Answers()
    for rid in ("FAIL-1", "FAIL-2", "ok-1", "ok-2"):
        submit(p, rec, rid, output="publish")
    p.start()
    try:
        rec.wait(4)
        assert p.workers_alive(stall_s=5.0) == {"synthesis-1": True, "synthesis-2": True}
        submit(p, rec, "ok-3", output="publish")
        rec.wait(5)
    finally:
        p.stop()
    assert rec.answers["FAIL-1"] == rec.answers["FAIL-2"] == ("error", "engine_error")
    assert rec.answers["ok-1"] == rec.answers["ok-2"] == rec.answers["ok-3"] == ("done", "completed")


def test_workers_take_requests_in_priority_order_and_the_engine_sees_it() -> None:
    engine = FakeSynthesizer(together=2)
    p, rec = make(engine, workers=2), Answers()
    for rid, prio in (("low", 0), ("mid", 1), ("high", 5), ("high2", 5)):
        submit(p, rec, rid, output="publish", priority=prio)
    p.start()
    try:
        rec.wait(4)
    finally:
        p.stop()
    assert set(engine.started[:2]) == {"high", "high2"} and set(engine.started[2:]) == {"mid", "low"}
    assert {t: s.priority for t, s in engine.seen.items()} == {"low": 0, "mid": 1, "high": 5, "high2": 5}
