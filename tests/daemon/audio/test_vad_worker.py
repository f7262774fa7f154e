"""The VAD worker on a paced source (a recording played as a microphone
would deliver it), half-duplex, robustness of its callbacks, and barge-in."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest
import soundfile as sf
from cosyedge_daemon.audio.barge_in import BargeInAction, BargeInPolicy
from cosyedge_daemon.audio.interfaces import VadEvent
from cosyedge_daemon.audio.sinks import NullSink
from cosyedge_daemon.audio.sources import ArraySource
from cosyedge_daemon.audio.vad_worker import VadWorker
from cosyedge_daemon.settings.audio import VadSettings

from tests.support.speech import Clip, load_clips, mix, require_speech_data


@pytest.fixture(scope="module")
def clips() -> dict[str, Clip]:
    data = require_speech_data()
    return load_clips(data)


class Recorder:
    def __init__(self) -> None:
        self.events: list[VadEvent] = []
        self.segments: list[tuple[bytes, float, float]] = []

    def on_event(self, e: VadEvent) -> None:
        self.events.append(e)

    def on_segment(self, wav: bytes, start_s: float, end_s: float) -> None:
        self.segments.append((wav, start_s, end_s))


def _run_worker(pcm16: np.ndarray, vs: VadSettings, rec: Recorder, realtime: bool = False,
                during=None) -> VadWorker:  # type: ignore[no-untyped-def]
    source = ArraySource(pcm16, vs.frame_ms, realtime=realtime)
    worker = VadWorker(source, vs, rec.on_event, rec.on_segment, queue_frames=100000)
    worker.start()
    if during is not None:
        during(worker)
    assert source.finished.wait(60)
    worker.stop()
    return worker


def test_worker_events_and_segments(clips: dict[str, Clip]) -> None:
    m = mix([clips["phrase1"], clips["digit"]], [0.8, 3.5], 5.5, "white", 20, seed=3)
    rec = Recorder()
    worker = _run_worker(m.pcm16, VadSettings(), rec)
    assert [e.kind for e in rec.events] == ["speech_start", "speech_end"] * 2
    pairs = list(zip(rec.events[::2], rec.events[1::2], strict=True))
    for (start, end), (s_ev, e_ev), (wav, s, e) in zip(m.truth, pairs, rec.segments, strict=True):
        assert abs(s_ev.time_s - start) <= 0.09 and abs(e_ev.time_s - end) <= 0.09
        assert (s, e) == (s_ev.time_s, e_ev.time_s)
        assert e_ev.utterance_ms == pytest.approx(1000 * (e - s))
        y, rate = sf.read(io.BytesIO(wav), dtype="int16")
        assert rate == 16000 and len(y) / 16000 == pytest.approx(e - s + 0.3 + 0.15, abs=0.031)
    assert worker.frames_dropped == 0 and worker.callback_errors == 0 and not worker.alive


def test_half_duplex_ignores_the_microphone_while_speaking(clips: dict[str, Clip]) -> None:
    m = mix([clips["phrase2"], clips["phrase1"]], [0.5, 3.4], 4.8)
    vs = VadSettings(half_duplex=True, barge_in="off", half_duplex_tail_ms=200)

    # the daemon speaks during the first utterance (its own voice, say): only the second is heard
    def speak(worker: VadWorker) -> None:
        worker.set_speaking(True)
        time.sleep(2.7)
        worker.set_speaking(False)

    rec = Recorder()
    worker = _run_worker(m.pcm16, vs, rec, realtime=True, during=speak)
    assert [e.kind for e in rec.events] == ["speech_start", "speech_end"]
    assert abs(rec.events[0].time_s - m.truth[1][0]) <= 0.09
    assert worker.frames_ignored >= int(2.7 / 0.03) - 2

    # speaking starts in the middle of an utterance: it is closed at once
    rec = Recorder()

    def interrupt(worker: VadWorker) -> None:
        time.sleep(1.5)
        worker.set_speaking(True)

    _run_worker(m.pcm16[:16000 * 3], vs, rec, realtime=True, during=interrupt)
    assert [e.kind for e in rec.events] == ["speech_start", "speech_end"]
    assert 0.9 < rec.events[1].time_s <= 1.55


def test_without_half_duplex_speech_while_speaking_is_heard(clips: dict[str, Clip]) -> None:
    m = mix([clips["phrase1"]], [0.5], 2.5)
    rec = Recorder()
    _run_worker(m.pcm16, VadSettings(), rec, during=lambda w: w.set_speaking(True))
    assert [e.kind for e in rec.events] == ["speech_start", "speech_end"]


def test_failing_callbacks_and_a_slow_consumer_do_not_stop_capture(clips: dict[str, Clip]) -> None:
    m = mix([clips["digit"], clips["digit"]], [0.5, 3.0], 4.5)
    calls: list[str] = []

    def bad_event(e: VadEvent) -> None:
        calls.append(e.kind)
        raise RuntimeError("broker gone")

    source = ArraySource(m.pcm16, 30, realtime=False)
    worker = VadWorker(source, VadSettings(), bad_event, queue_frames=100000)
    worker.start()
    assert source.finished.wait(30)
    worker.stop()
    assert calls == ["speech_start", "speech_end"] * 2 and worker.callback_errors == 4

    # on_frame never blocks: with a 5-frame queue and a stalled worker, frames are dropped and counted
    gate = threading.Event()
    source = ArraySource(m.pcm16, 30, realtime=False)
    worker = VadWorker(source, VadSettings(), lambda e: gate.wait(5), queue_frames=5)
    worker.start()
    assert source.finished.wait(10)  # the source ran through in spite of the stalled worker
    gate.set()
    worker.stop()
    assert worker.frames_dropped > 0 and worker.frames_in == source.frames_sent


def test_frame_length_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="source frames are 20 ms, the VAD expects 30 ms"):
        VadWorker(ArraySource(np.zeros(100, np.int16), 20), VadSettings(), lambda e: None)


# --- barge-in ----------------------------------------------------------------

START, END = VadEvent("speech_start", 1.0), VadEvent("speech_end", 2.0, 1000.0)


def test_barge_in_policy_table() -> None:
    stop = BargeInPolicy(VadSettings(barge_in="stop"))
    assert stop.on_vad_event(START, speaking=True) == BargeInAction("stop")
    assert stop.on_vad_event(START, speaking=False).kind == "none"
    assert stop.on_vad_event(END, speaking=False).kind == "none"
    off = BargeInPolicy(VadSettings(barge_in="off"))
    assert off.on_vad_event(START, speaking=True).kind == "none"
    duck = BargeInPolicy(VadSettings(barge_in="duck", duck_gain=0.3))
    assert duck.on_vad_event(START, speaking=True) == BargeInAction("duck", 0.3)
    assert duck.ducked and duck.on_vad_event(START, speaking=True).kind == "none"
    assert duck.on_vad_event(END, speaking=True) == BargeInAction("unduck", 1.0)
    assert not duck.ducked and duck.on_vad_event(END, speaking=True).kind == "none"
    duck.on_vad_event(START, speaking=True)
    assert duck.on_speaking_changed(False) == BargeInAction("unduck", 1.0)
    assert duck.on_speaking_changed(False).kind == "none"


def test_barge_in_stops_playback_on_recorded_speech(clips: dict[str, Clip]) -> None:
    """The daemon's wiring in small: a paced sink is playing, the microphone
    hears speech, the policy says stop, the playback is flushed."""
    sink = NullSink(24000, paced=True, buffer_ms=10000)
    sink.write(np.zeros(24000 * 8, np.float32))  # 8 s of "speech" queued
    policy = BargeInPolicy(VadSettings())
    actions: list[tuple[str, float]] = []

    def on_event(e: VadEvent) -> None:
        action = policy.on_vad_event(e, speaking=sink.playing)
        actions.append((action.kind, e.time_s))
        if action.kind == "stop":
            sink.flush()

    m = mix([clips["phrase1"]], [0.6], 2.0)
    source = ArraySource(m.pcm16, 30, realtime=True)
    worker = VadWorker(source, VadSettings(), on_event)
    worker.start()
    assert source.finished.wait(10)
    worker.stop()
    assert actions[0][0] == "stop" and abs(actions[0][1] - 0.6) <= 0.09
    assert not sink.playing
