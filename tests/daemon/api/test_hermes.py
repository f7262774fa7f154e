"""Rhasspy Hermes compatibility, checked against the protocol's own message
classes (the `rhasspy-hermes` package) where it has them; voiceActivity
vadUp/vadDown (which rhasspy-hermes 0.6.2 has no class for) against the
Snips Hermes schema {siteId, signalMs}."""

from __future__ import annotations

import io
import json
import wave

from cosyedge_daemon.audio.interfaces import VadEvent

from tests.daemon.conftest import DaemonFactory
from tests.support.components import missing
from tests.support.memory_sink import MemorySink

try:  # the Hermes payload classes (test only; .ci/requirements-nodeps.txt)
    import rhasspyhermes.audioserver as audioserver
    import rhasspyhermes.tts as tts
except ImportError as exc:
    missing(f"rhasspy-hermes does not import ({exc}); pip install --no-deps rhasspy-hermes==0.6.2 "
            "(and audioop-lts on Python 3.13+)")


def _say(site: str, rid: str | None, session: str | None = "sess-1", text: str = "Hello from Hermes.") -> str:
    msg = tts.TtsSay(text=text, site_id=site, id=rid, session_id=session)
    assert msg.topic() == "hermes/tts/say"
    return str(msg.payload())


def test_say_published_as_play_bytes_then_say_finished(daemons: DaemonFactory) -> None:
    svc = daemons.start(hermes={"site_ids": ["kitchen"], "output": "publish"})
    p = daemons.probe(svc, extra_topics=("hermes/#",))
    p.publish("hermes/tts/say", _say("kitchen", "h-1"))
    finished = p.wait_topic(tts.TtsSayFinished.topic())
    fin = tts.TtsSayFinished.from_dict(finished.json())
    assert (fin.id, fin.site_id, fin.session_id) == ("h-1", "kitchen", "sess-1")
    play = next(m for m in p.messages if audioserver.AudioPlayBytes.is_topic(m.topic))
    assert audioserver.AudioPlayBytes.get_site_id(play.topic) == "kitchen"
    assert audioserver.AudioPlayBytes.get_request_id(play.topic) == "h-1"
    assert play.at <= finished.at
    with wave.open(io.BytesIO(play.payload)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() > 24000 * 0.5


def test_other_sites_ignored_and_null_id_echoed(daemons: DaemonFactory) -> None:
    svc = daemons.start(hermes={"site_ids": ["kitchen"], "output": "publish"})
    p = daemons.probe(svc, extra_topics=("hermes/#",))
    p.publish("hermes/tts/say", _say("garage", "not-mine"))
    p.publish("hermes/tts/say", _say("kitchen", None, session=None, text="No id."))
    fin = tts.TtsSayFinished.from_dict(p.wait_topic("hermes/tts/sayFinished").json())
    assert (fin.id, fin.site_id, fin.session_id) == (None, "kitchen", None)
    assert len(p.on("hermes/tts/sayFinished")) == 1
    assert not any("not-mine" in m.topic for m in p.messages)


def test_play_locally_by_default_site_is_device_id(daemons: DaemonFactory) -> None:
    sink = MemorySink(speed=8.0)
    svc = daemons.start(sink=sink)
    p = daemons.probe(svc, extra_topics=("hermes/#",))
    p.publish("hermes/tts/say", _say(svc.settings.device_id, "local-1"))
    fin = p.wait_topic("hermes/tts/sayFinished").json()
    assert fin["id"] == "local-1" and sink.played_seconds() > 0.5
    assert not any(audioserver.AudioPlayBytes.is_topic(m.topic) for m in p.messages)


def test_errors_on_hermes_error_tts(daemons: DaemonFactory) -> None:
    svc = daemons.start(fallback=None, local=None, hermes={"site_ids": ["s1"], "output": "publish"})
    p = daemons.probe(svc, extra_topics=("hermes/#",))
    p.publish("hermes/tts/say", _say("s1", "e-1"))
    err = tts.TtsError.from_dict(p.wait_topic(tts.TtsError.topic()).json())
    assert err.site_id == "s1" and err.session_id == "sess-1" and "synthesizer_unavailable" in err.error
    assert err.context == "e-1"
    fin = p.wait_topic("hermes/tts/sayFinished").json()  # so a dialogue manager never waits forever
    assert fin["id"] == "e-1"
    p.publish("hermes/tts/say", json.dumps({"siteId": "s1", "text": 5}))
    bad = p.wait_for(lambda m: m.topic == "hermes/error/tts" and "'text'" in m.json()["error"])
    assert tts.TtsError.from_dict(bad.json()).site_id == "s1"


def test_voice_activity_and_native_vad_events(daemons: DaemonFactory) -> None:
    svc = daemons.start()
    site = svc.settings.device_id
    p = daemons.probe(svc, extra_topics=("hermes/#",))
    svc.voice.on_vad_event(VadEvent("speech_start", 1.25))
    svc.voice.on_vad_event(VadEvent("speech_end", 2.5, utterance_ms=1250.0))
    up = p.wait_topic(f"hermes/voiceActivity/{site}/vadUp").json()
    down = p.wait_topic(f"hermes/voiceActivity/{site}/vadDown").json()
    assert up == {"siteId": site, "signalMs": 1250} and down == {"siteId": site, "signalMs": 2500}
    pre = svc.settings.topic_prefix
    p.wait_for(lambda m: len(p.on(f"{pre}/vad/event")) == 2)
    events = [m.json() for m in p.on(f"{pre}/vad/event")]
    assert [e["event"] for e in events] == ["speech_start", "speech_end"]
    assert events[1]["utterance_ms"] == 1250.0 and events[0]["speaking"] is False
    svc.voice.on_utterance(b"RIFF....WAVE")
    assert p.wait_topic(f"{pre}/vad/segment").payload == b"RIFF....WAVE"


def test_only_a_usable_hermes_id_is_remembered_for_the_duplicate_check() -> None:
    from cosyedge_daemon.api.hermes import parse_hermes_say
    from cosyedge_daemon.request.request import RequestLimits

    def say(extra: dict[str, object]) -> bool:
        payload = json.dumps({"siteId": "s1", "text": "Hi.", **extra}).encode()
        parsed = parse_hermes_say(payload, RequestLimits(), ("s1",), "publish", 0.0)
        assert parsed is not None
        return parsed.request.client_id

    assert say({"id": "h-1"}) and not say({}) and not say({"id": "bad id\n"})
