"""The native TTS API end to end: a real Mosquitto, the in-process daemon,
the engine under test, and the test sink standing in for a sound card."""

from __future__ import annotations

import numpy as np
from cosyedge_daemon.api.tts_messages import decode_audio

from tests.daemon.conftest import DaemonFactory
from tests.support.fake_synthesizer import GatedSynthesizer
from tests.support.memory_sink import MemorySink
from tests.support.waiting import wait_until

THREE = "Hello there, this is the first sentence. Here comes the second one. And this is the third."
LONG = " ".join(f"This is sentence number {n} of a long announcement." for n in range(1, 9))


def _topics(prefix: str, rid: str) -> tuple[str, str, str]:
    return f"{prefix}/tts/audio/{rid}", f"{prefix}/tts/done/{rid}", f"{prefix}/tts/error/{rid}"


def test_say_publishes_audio_chunks_then_done(daemons: DaemonFactory) -> None:
    svc = daemons.start()
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    audio_t, done_t, _ = _topics(pre, "s1")
    p.publish(f"{pre}/tts/say", {"id": "s1", "text": THREE, "output": "publish"})
    done_msg = p.wait_topic(done_t)
    done = done_msg.json()
    chunks = p.on(audio_t)
    assert len(chunks) == 3 and all(c.at <= done_msg.at for c in chunks)
    decoded = [decode_audio(c.payload, c.user_properties) for c in chunks]
    assert [d.seq for d in decoded] == [0, 1, 2] and [d.last for d in decoded] == [False, False, True]
    assert {d.sample_rate for d in decoded} == {24000}
    pcm = np.frombuffer(b"".join(d.pcm16 for d in decoded), "<i2")
    assert np.abs(pcm).max() > 3000  # speech
    assert abs(pcm.size / 24000 - done["audio_seconds"]) < 0.01
    assert (done["id"], done["route"], done["reason"], done["chunks"]) == ("s1", "local", "completed", 3)
    assert done["first_audio_ms"] > 0 and done["rtf"] > 0
    assert set(done["trace"]) >= {
        "queued_ms",
        "frontend_ms",
        "llm_ms",
        "flow_ms",
        "vocoder_ms",
        "first_audio_ms",
        "playback_ms",
    }


def test_play_output_goes_to_the_sink_and_overlaps_synthesis(daemons: DaemonFactory) -> None:
    sink = MemorySink(speed=2.0)
    engine = GatedSynthesizer(chunks=3)  # its first chunk at once, the rest when the test opens the gate
    svc = daemons.start(sink=sink, local=engine)
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    speaking: list[bool] = []
    svc.speaking_listeners.append(speaking.append)
    sink.hold()  # the device plays nothing until resumed: p1 cannot finish before that
    p.publish(f"{pre}/tts/say", {"id": "p1", "text": "First request."})
    p.publish(f"{pre}/tts/say", {"id": "p2", "text": "Second request."})
    # Playback starts on the first chunk, not after the whole text was synthesized.
    assert sink.wait(lambda: sink.written > 0), "the first chunk did not reach the sink"
    assert not engine.gate.is_set()
    engine.gate.set()
    # Pipelining: p2 is synthesized while p1 still plays (it cannot finish: the sink holds it).
    wait_until(lambda: "Second request." in engine.started, 20)
    assert not p.on(f"{pre}/tts/done/p1")
    sink.resume()
    first = p.wait_topic(f"{pre}/tts/done/p1").json()
    second = p.wait_topic(f"{pre}/tts/done/p2").json()
    assert not p.on(f"{pre}/tts/audio/p1")  # play only: nothing on the audio topic
    assert first["output"] == "play" and first["trace"]["playback_ms"] > 0
    assert abs(first["audio_seconds"] - 3 * engine.chunk_samples / engine.sample_rate) < 1e-3
    played = sink.played_seconds()
    assert abs(played - first["audio_seconds"] - second["audio_seconds"]) < 0.05
    assert speaking[0] is True and speaking[-1] is False
    assert not svc.voice.speaking


def _playing(sink: MemorySink) -> None:
    """Until the first request's audio reaches the sink: it runs, and with synth_ahead_chunks = 1
    the synthesis worker is held back by its playback."""
    assert sink.wait(lambda: sink.written > 0), "nothing reached the sink"


def test_cancel_queued_and_running(daemons: DaemonFactory) -> None:
    sink = MemorySink(speed=1.0)
    svc = daemons.start(sink=sink, scheduler={"synth_ahead_chunks": 1})
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    p.publish(f"{pre}/tts/say", {"id": "c1", "text": LONG})
    p.publish(f"{pre}/tts/say", {"id": "c2", "text": LONG})
    _playing(sink)
    wait_until(lambda: svc.scheduler.check_duplicate("c2") is not None)  # c2 is queued
    p.publish(f"{pre}/tts/cancel", {"id": "c2"})
    err2 = p.wait_topic(f"{pre}/tts/error/c2", 5).json()
    assert (err2["id"], err2["code"]) == ("c2", "cancelled")
    p.publish(f"{pre}/tts/cancel", {"id": "c1"})
    err1 = p.wait_topic(f"{pre}/tts/error/c1", 5)
    assert err1.json()["code"] == "cancelled"
    assert sink.wait(lambda: sink.flushes >= 1 and not sink.playing, 10)
    assert not p.on(f"{pre}/tts/done/c1") and not p.on(f"{pre}/tts/done/c2")
    p.publish(f"{pre}/tts/cancel", {"id": "unknown"})  # ignored, no answer
    p.publish(f"{pre}/tts/say", {"id": "c3", "text": LONG, "output": "publish"})
    whole = p.wait_topic(f"{pre}/tts/done/c3").json()
    assert whole["reason"] == "completed"
    assert sink.played_seconds() < whole["audio_seconds"]  # c1 stopped before its end
    assert not p.on(f"{pre}/tts/error/unknown")


def test_higher_priority_goes_first(daemons: DaemonFactory) -> None:
    sink = MemorySink(speed=8.0)
    svc = daemons.start(sink=sink, scheduler={"synth_ahead_chunks": 1})
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    sink.hold()  # "a" keeps the synthesis worker until all three below are queued
    p.publish(f"{pre}/tts/say", {"id": "a", "text": LONG})
    _playing(sink)
    p.publish(f"{pre}/tts/say", {"id": "low1", "text": "Low one.", "priority": 0})
    p.publish(f"{pre}/tts/say", {"id": "low2", "text": "Low two.", "priority": 0})
    p.publish(f"{pre}/tts/say", {"id": "high", "text": "High.", "priority": 5})
    wait_until(lambda: all(svc.scheduler.check_duplicate(r) is not None for r in ("low1", "low2", "high")))
    sink.resume()
    for rid in ("a", "low1", "low2", "high"):
        p.wait_topic(f"{pre}/tts/done/{rid}", 30)
    order = [m.topic.rsplit("/", 1)[1] for m in p.messages if "/tts/done/" in m.topic]
    assert order == ["a", "high", "low1", "low2"]


def test_preemption_interrupts_lower_priority(daemons: DaemonFactory) -> None:
    sink = MemorySink(speed=1.0)
    svc = daemons.start(sink=sink, scheduler={"preempt": True})
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    p.publish(f"{pre}/tts/say", {"id": "bg", "text": LONG, "priority": 0})
    _playing(sink)
    p.publish(f"{pre}/tts/say", {"id": "alarm", "text": "Fire alarm.", "priority": 10})
    bg = p.wait_topic(f"{pre}/tts/done/bg", 10).json()
    alarm = p.wait_topic(f"{pre}/tts/done/alarm", 10).json()
    assert bg["reason"] == "preempted" and alarm["reason"] == "completed"
    assert sink.played_seconds() < bg["audio_seconds"] + alarm["audio_seconds"]


def test_deadline_exceeded_while_queued(daemons: DaemonFactory) -> None:
    sink = MemorySink(speed=1.0)
    svc = daemons.start(sink=sink, scheduler={"synth_ahead_chunks": 1})
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    p.publish(f"{pre}/tts/say", {"id": "long", "text": LONG})
    _playing(sink)
    t = p.publish(f"{pre}/tts/say", {"id": "late", "text": "Too late.", "deadline_ms": 300})
    err = p.wait_topic(f"{pre}/tts/error/late", 5)
    assert err.json()["code"] == "deadline_exceeded"
    assert err.at - t >= 0.25  # not before its deadline (a loaded machine can only make it later)
    p.publish(f"{pre}/tts/cancel", {"id": "long"})
    p.publish(f"{pre}/tts/say", {"id": "ok", "text": "In time.", "deadline_ms": 5000, "output": "publish"})
    assert p.wait_topic(f"{pre}/tts/done/ok").json()["reason"] == "completed"


def test_duplicate_id_is_never_spoken_twice(daemons: DaemonFactory) -> None:
    sink = MemorySink(speed=2.0)
    svc = daemons.start(sink=sink)
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    body = {"id": "dup", "text": "Only once, please.", "output": "both"}
    p.publish(f"{pre}/tts/say", body)
    p.publish(f"{pre}/tts/say", body)  # redelivered while in flight: ignored
    first = p.wait_topic(f"{pre}/tts/done/dup").json()
    chunks = len(p.on(f"{pre}/tts/audio/dup"))
    played = sink.played_seconds()
    p.publish(f"{pre}/tts/say", body)  # after it finished: the original answer again
    p.wait_for(lambda m: len(p.on(f"{pre}/tts/done/dup")) == 2, 5)
    # a request after it, answered: a late audio chunk or answer of "dup" would have come first
    p.publish(f"{pre}/tts/say", {"id": "after", "text": "After.", "output": "both"})
    after = p.wait_topic(f"{pre}/tts/done/after").json()
    dones = [m.json() for m in p.on(f"{pre}/tts/done/dup")]
    assert len(dones) == 2 and dones[1] == first
    assert len(p.on(f"{pre}/tts/audio/dup")) == chunks
    assert abs(sink.played_seconds() - played - after["audio_seconds"]) < 0.05


def test_queue_full_answers_busy(daemons: DaemonFactory) -> None:
    sink = MemorySink(speed=1.0)
    svc = daemons.start(sink=sink, scheduler={"max_queue": 1, "synth_ahead_chunks": 1})
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    p.publish(f"{pre}/tts/say", {"id": "q1", "text": LONG})
    _playing(sink)
    p.publish(f"{pre}/tts/say", {"id": "q2", "text": "Queued."})
    p.publish(f"{pre}/tts/say", {"id": "q3", "text": "No room."})
    err = p.wait_topic(f"{pre}/tts/error/q3", 5).json()
    assert err["code"] == "busy" and "queue is full" in err["message"]
    p.publish(f"{pre}/tts/cancel", {"id": "q1"})
    assert p.wait_topic(f"{pre}/tts/done/q2", 10).json()["reason"] == "completed"
    p.publish(f"{pre}/tts/say", {"id": "q3", "text": "Room now."})  # a busy id may be retried
    assert p.wait_topic(f"{pre}/tts/done/q3", 10).json()["reason"] == "completed"
