"""Bad input, protocol versions, broker restarts, engine failures and
fallback, engine reload: the daemon answers every request and keeps serving."""

from __future__ import annotations

import json
import time
from pathlib import Path

from cosyedge_daemon.api.tts_messages import decode_audio
from cosyedge_daemon.synthesizers.espeak import EspeakSynthesizer

from tests.daemon.api.test_daemon_api import LONG, THREE
from tests.daemon.conftest import DaemonFactory, make_settings
from tests.support.memory_sink import MemorySink


def failing_espeak(tmp_path: Path, when: str = "always") -> EspeakSynthesizer:
    """The real espeak-ng behind a wrapper that makes it fail (exit 3) always,
    or only for sentences containing FAIL."""
    script = tmp_path / f"espeak-{when}"
    cond = "true" if when == "always" else 'case "$text" in *FAIL*) true;; *) false;; esac'
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --voices ]; then exec espeak-ng "$@"; fi\n'
        "text=$(cat)\n"
        f'if {cond}; then echo "Error: injected failure" >&2; exit 3; fi\n'
        'printf "%s" "$text" | exec espeak-ng "$@"\n'
    )
    script.chmod(0o755)
    return EspeakSynthesizer(binary=str(script))


BAD_INPUTS = [
    ("malformed JSON", b'{"text": "hi"', "_", "invalid_json"),
    ("wrong type", json.dumps({"id": "w1", "text": 42}).encode(), "w1", "invalid_field"),
    (
        "wrong priority type",
        json.dumps({"id": "w2", "text": "x", "priority": "1"}).encode(),
        "w2",
        "invalid_field",
    ),
    ("invalid UTF-8", b'{"text": "\xc3\x28"}', "_", "invalid_utf8"),
    ("text of 1 MB", json.dumps({"id": "big", "text": "a" * 1_000_000}).encode(), "big", "text_too_long"),
    (
        "unknown voice",
        json.dumps({"id": "v1", "text": "x", "voice": "no-such-voice"}).encode(),
        "v1",
        "unknown_voice",
    ),
    ("unknown mode", json.dumps({"id": "m1", "text": "x", "mode": "whisper"}).encode(), "m1", "unknown_mode"),
    (
        "unsupported mode",
        json.dumps({"id": "m2", "text": "x", "mode": "instruct", "instruct_text": "sad"}).encode(),
        "m2",
        "unsupported_mode",
    ),
    ("binary garbage", bytes(range(256)) * 8, "_", "invalid_utf8"),
    ("empty payload", b"", "_", "empty_payload"),
    ("oversized payload", b"{" + b" " * 2_100_000 + b"}", "_", "payload_too_large"),  # within the packet headroom
    ("JSON array", b"[1, 2, 3]", "_", "invalid_request"),
    ("bad id", json.dumps({"id": "a/b#", "text": "x"}).encode(), "_", "invalid_id"),
    (
        "bad prompt",
        json.dumps({"id": "pr", "text": "x", "prompt": {"wav": "AAAA"}}).encode(),
        "pr",
        "invalid_prompt",
    ),
]


def test_bad_input_corpus_each_answered_daemon_keeps_serving(daemons: DaemonFactory) -> None:
    svc = daemons.start()
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    for n, (name, payload, rid, code) in enumerate(BAD_INPUTS):
        before = len(p.on(f"{pre}/tts/error/{rid}"))
        p.publish(f"{pre}/tts/say", payload)
        p.wait_for(lambda m, rid=rid, before=before: len(p.on(f"{pre}/tts/error/{rid}")) > before, 10)
        err = p.on(f"{pre}/tts/error/{rid}")[before].json()
        assert err["code"] == code, name
        assert err["id"] == (None if rid == "_" else rid) and err["message"], name
        p.publish(f"{pre}/tts/say", {"id": f"ok{n}", "text": "Still fine.", "output": "publish"})
        assert p.wait_topic(f"{pre}/tts/done/ok{n}").json()["reason"] == "completed", name
    before = len(p.on(f"{pre}/tts/error/_"))
    p.publish(f"{pre}/tts/cancel", b"\xff\x01garbage")
    p.wait_for(lambda m: len(p.on(f"{pre}/tts/error/_")) > before)
    assert p.on(f"{pre}/tts/error/_")[before].json()["code"] == "invalid_utf8"
    assert svc.liveness() == {"synthesis-1": True, "intake": True}


def test_v5_response_topic_and_correlation_data(daemons: DaemonFactory) -> None:
    svc = daemons.start()
    pre = svc.settings.topic_prefix
    reply = f"{pre}/reply/client-7"
    p = daemons.probe(svc, extra_topics=(f"{pre}/reply/#",))
    p.publish(
        f"{pre}/tts/say",
        {"id": "r1", "text": "Reply to me. Twice.", "output": "publish"},
        response_topic=reply,
        correlation=b"\x01corr",
    )
    p.wait_for(lambda m: m.topic == reply and ("kind", "done") in m.user_properties)
    on_reply = p.on(reply)
    kinds = [dict(m.user_properties)["kind"] for m in on_reply]
    assert kinds == ["audio", "audio", "done"]
    assert all(m.correlation_data == b"\x01corr" for m in on_reply)
    assert json.loads(on_reply[-1].payload)["id"] == "r1"
    assert decode_audio(on_reply[0].payload, on_reply[0].user_properties).seq == 0
    std = p.wait_topic(f"{pre}/tts/done/r1")
    assert std.correlation_data == b"\x01corr"
    p.publish(
        f"{pre}/tts/say", {"id": "r2", "text": "x", "voice": "nope"}, response_topic=reply, correlation=b"c2"
    )
    err = p.wait_for(lambda m: m.topic == reply and ("kind", "error") in m.user_properties)
    assert err.correlation_data == b"c2" and err.json()["code"] == "unknown_voice"


def test_mqtt_311_daemon_and_client(daemons: DaemonFactory) -> None:
    svc = daemons.start(mqtt={"protocol": "3.1.1"})
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc, protocol="3.1.1")
    p.publish(f"{pre}/tts/say", {"id": "v3", "text": "Old protocol. Still works.", "output": "publish"})
    done = p.wait_topic(f"{pre}/tts/done/v3").json()
    chunks = p.on(f"{pre}/tts/audio/v3")
    assert all(c.payload[:4] == b"CEA1" and not c.user_properties for c in chunks)
    decoded = [decode_audio(c.payload, None) for c in chunks]
    assert [d.seq for d in decoded] == [0, 1] and decoded[-1].last and decoded[0].sample_rate == 24000
    assert abs(sum(len(d.pcm16) for d in decoded) / 2 / 24000 - done["audio_seconds"]) < 0.01
    # A subscriber that comes after the announcement gets it retained.
    online = daemons.probe(svc, protocol="3.1.1").wait_topic(f"{pre}/status")
    assert online.payload == b"online" and online.retain


def test_v311_client_on_v5_daemon(daemons: DaemonFactory) -> None:
    svc = daemons.start(mqtt={"audio_header": "always"})
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc, protocol="3.1.1")
    p.publish(f"{pre}/tts/say", {"id": "mix", "text": "Mixed versions.", "output": "publish"})
    p.wait_topic(f"{pre}/tts/done/mix")
    assert decode_audio(p.on(f"{pre}/tts/audio/mix")[0].payload, None).last


def test_broker_restart_mid_request(daemons: DaemonFactory) -> None:
    sink = MemorySink(speed=6.0)
    svc = daemons.start(sink=sink)
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    p.publish(f"{pre}/tts/say", {"id": "br", "text": LONG, "output": "both"})
    p.wait_topic(f"{pre}/tts/audio/br")
    daemons.broker.restart(down_s=0.5)
    end = p.wait_for(lambda m: m.topic in (f"{pre}/tts/done/br", f"{pre}/tts/error/br"), 30)
    # The request was playing: it plays to its end across the restart and is answered once, with done.
    assert end.topic == f"{pre}/tts/done/br", end.payload[:200]
    assert end.json()["reason"] == "completed" and end.json()["route"] == "local"
    time.sleep(0.3)
    assert len(p.on(f"{pre}/tts/done/br")) == 1 and not p.on(f"{pre}/tts/error/br")
    assert svc.conn.connect_count == 2
    p.publish(f"{pre}/tts/say", {"id": "after", "text": "Back again.", "output": "publish"})
    assert p.wait_topic(f"{pre}/tts/done/after", 15).json()["reason"] == "completed"


def test_fallback_when_local_engine_missing_or_failing(daemons: DaemonFactory, tmp_path: Path) -> None:
    svc = daemons.start(local=None)
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    p.publish(f"{pre}/tts/say", {"id": "f1", "text": "Fallback voice.", "output": "publish"})
    done = p.wait_topic(f"{pre}/tts/done/f1").json()
    assert done["route"] == "fallback" and done["route_reason"] == "no local engine"

    svc2 = daemons.start(local=failing_espeak(tmp_path))
    pre2 = svc2.settings.topic_prefix
    p2 = daemons.probe(svc2)
    p2.publish(f"{pre2}/tts/say", {"id": "f2", "text": "Synthesizer breaks.", "output": "publish"})
    done2 = p2.wait_topic(f"{pre2}/tts/done/f2").json()
    assert done2["route"] == "fallback" and "local engine failed" in done2["route_reason"]
    assert "injected failure" in done2["route_reason"]
    for n in range(3):  # after max_consecutive_failures the router skips the broken engine
        p2.publish(f"{pre2}/tts/say", {"id": f"g{n}", "text": "Again.", "output": "publish"})
        p2.wait_topic(f"{pre2}/tts/done/g{n}")
    assert "unhealthy" in p2.on(f"{pre2}/tts/done/g2")[0].json()["route_reason"]


def test_failure_after_audio_is_an_error_not_a_retry(daemons: DaemonFactory, tmp_path: Path) -> None:
    svc = daemons.start(local=failing_espeak(tmp_path, when="marker"))
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    p.publish(f"{pre}/tts/say", {"id": "half", "text": "This part works. FAIL here.", "output": "publish"})
    err = p.wait_topic(f"{pre}/tts/error/half").json()
    assert err["code"] == "engine_error" and "injected failure" in err["message"]
    assert len(p.on(f"{pre}/tts/audio/half")) == 1
    assert not p.on(f"{pre}/tts/done/half")


def test_no_engine_and_no_cloud(daemons: DaemonFactory, tmp_path: Path) -> None:
    svc = daemons.start(local=failing_espeak(tmp_path), fallback=None)
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    p.publish(f"{pre}/tts/say", {"id": "e1", "text": "x", "output": "publish"})
    assert p.wait_topic(f"{pre}/tts/error/e1").json()["code"] == "engine_error"
    p.publish(f"{pre}/tts/say", {"id": "c1", "text": "x", "route": "cloud", "output": "publish"})
    assert p.wait_topic(f"{pre}/tts/error/c1").json()["code"] == "cloud_unavailable"
    svc.set_synthesizers(None, None)
    p.publish(f"{pre}/tts/say", {"id": "e2", "text": "x", "output": "publish"})
    err = p.wait_topic(f"{pre}/tts/error/e2").json()
    assert (err["code"], err["alias"]) == ("synthesizer_unavailable", "engine_unavailable")
    p.publish(f"{pre}/tts/say", {"id": "np", "text": "x", "output": "play"})
    assert p.wait_topic(f"{pre}/tts/error/np").json()["code"] == "no_audio_device"


class TrackedEspeak(EspeakSynthesizer):
    closed = False

    def close(self) -> None:
        self.closed = True


def test_engine_reload_without_dropping_requests(daemons: DaemonFactory) -> None:
    settings = make_settings(daemons.broker.url, tts={"engine": "espeak-ng"})
    old = TrackedEspeak()
    sink = MemorySink(speed=4.0)
    svc = daemons.start(sink=sink, settings=settings, local=old)
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    p.publish(f"{pre}/tts/say", {"id": "during", "text": THREE})
    time.sleep(0.3)
    p.publish(f"{pre}/admin/reload", b"")
    p.publish(f"{pre}/tts/say", {"id": "next", "text": "After the switch."})
    done = p.wait_topic(f"{pre}/tts/done/during", 15).json()
    assert done["reason"] == "completed"
    assert p.wait_topic(f"{pre}/tts/done/next", 15).json()["reason"] == "completed"
    deadline = time.monotonic() + 5
    while (svc.synthesizers.slots["local"].engine is old or not old.closed) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert svc.synthesizers.slots["local"].engine is not old
    assert old.closed


def test_health_document_and_status(daemons: DaemonFactory) -> None:
    svc = daemons.start(health={"health_interval_s": 1.0})
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    assert p.wait_topic(f"{pre}/status").payload == b"online"
    # Live or retained depends on who came first; a later subscriber must get it retained.
    status = daemons.probe(svc).wait_topic(f"{pre}/status")
    assert status.payload == b"online" and status.retain
    # The first document may predate readiness on a loaded machine; a ready one must follow.
    health = p.wait_for(lambda m: m.topic == f"{pre}/status/health" and m.json().get("state") == "ready").json()
    assert health["engines"]["local"]["state"] == "ready"
    assert health["engines"]["cloud"]["state"] == "absent"
    assert health["workers"] == {"synthesis-1": True, "intake": True}
    svc.synthesizers.slots["local"].swap(None)
    changed = p.wait_for(lambda m: m.topic == f"{pre}/status/health" and m.json()["state"] == "degraded", 5)
    assert changed.json()["engines"]["local"]["state"] == "absent"
    svc.stop(timeout_s=1)
    late = daemons.probe(svc)  # a new subscriber sees the retained offline
    assert late.wait_topic(f"{pre}/status", 5).payload == b"offline"
