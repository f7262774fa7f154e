"""Regression tests of issue 11's findings, each on the real broker with the
in-process daemon: one message must not take the device offline, every
request is answered, no client can mark the engine unhealthy for others,
ResponseTopics are policed, answers keep the id, Hermes answers only for its
own sites, size limits hold before the payload is read, echoes are clipped."""

from __future__ import annotations

import json
import logging
import time

import pytest
from cosyedge_cloud.wire.broker import LocalBroker
from cosyedge_daemon.mqtt.connection import max_packet_bytes

from tests.daemon.conftest import DaemonFactory
from tests.support.components import require_binary
from tests.support.mqtt_recorder import Recorder


def _served(p: Recorder, pre: str, rid: str) -> dict:  # type: ignore[type-arg]
    p.publish(f"{pre}/tts/say", {"id": rid, "text": "Still here.", "output": "publish"})
    return p.wait_topic(f"{pre}/tts/done/{rid}", 20).json()  # type: ignore[no-any-return]


def _errors(p: Recorder, pre: str, rid: str, n: int = 1, timeout_s: float = 10) -> list[dict]:  # type: ignore[type-arg]
    p.wait_for(lambda _m: len(p.on(f"{pre}/tts/error/{rid}")) >= n, timeout_s)
    return [m.json() for m in p.on(f"{pre}/tts/error/{rid}")]


def test_1_newline_in_id_is_refused_and_the_device_stays_online(daemons: DaemonFactory) -> None:
    svc = daemons.start(hermes={"output": "publish"})
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc, extra_topics=("hermes/#",))
    p.publish(f"{pre}/tts/say", b'{"id":"nl\\n","text":"Hi."}')
    assert _errors(p, pre, "_")[0]["code"] == "invalid_id"
    site = svc.settings.device_id
    p.publish("hermes/tts/say", json.dumps({"id": "h\n", "text": "Hi.", "siteId": site}))
    fin = p.wait_topic("hermes/tts/sayFinished", 20).json()
    assert fin == {"id": "h\n", "siteId": site, "sessionId": None}  # echoed in the payload, never in a topic
    play = [m.topic for m in p.messages if m.topic.startswith(f"hermes/audioServer/{site}/playBytes/")]
    assert len(play) == 1 and "\n" not in play[0]
    time.sleep(1.0)  # a malformed publish would have cost the connection by now
    assert svc.conn.connect_count == 1 and svc.conn.connected.is_set()
    assert {m.payload for m in p.on(f"{pre}/status")} == {b"online"}  # never offline
    assert _served(p, pre, "after-nl")["reason"] == "completed"


def test_1_a_topic_with_a_control_character_is_never_published(daemons: DaemonFactory) -> None:
    svc = daemons.start()
    assert svc.conn.publish("x/a\nb", b"1") is None
    assert svc.conn.publish("x/a+b", b"1") is None
    assert svc.conn.publish("x/ok", b"1") is not None


def test_2_over_long_json_integers_are_answered(daemons: DaemonFactory) -> None:
    svc = daemons.start(hermes={"site_ids": ["kitchen"], "output": "publish"})
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc, extra_topics=("hermes/#",))
    big = "9" * 5000
    p.publish(f"{pre}/tts/say", f'{{"id": "big1", "text": "x", "priority": {big}}}'.encode())
    err = _errors(p, pre, "big1")[0]
    assert err["code"] == "invalid_json" and err["id"] == "big1"
    p.publish(f"{pre}/tts/cancel", f'{{"id": {big}}}'.encode())
    assert _errors(p, pre, "_")[0]["code"] == "invalid_json"
    p.publish(f"{pre}/admin/reload", f'{{"bundle": {big}}}'.encode())
    assert _errors(p, pre, "_", 2)[1]["code"] == "invalid_json"
    p.publish("hermes/tts/say", f'{{"siteId": "kitchen", "id": "hb", "text": "x", "volume": {big}}}'.encode())
    fin = p.wait_topic("hermes/tts/sayFinished").json()
    assert fin == {"id": "hb", "siteId": "kitchen", "sessionId": None}
    assert "not valid JSON" in p.wait_topic("hermes/error/tts").json()["error"]


def test_3_a_client_cannot_make_the_engine_unhealthy(daemons: DaemonFactory) -> None:
    svc = daemons.start()
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    for n in range(4):
        p.publish(f"{pre}/tts/say", {"id": f"seed{n}", "text": "x", "seed": -1, "output": "publish"})
        p.publish(f"{pre}/tts/say", {"id": f"wild{n}", "text": "x", "output": "publish"}, response_topic="a/+/b")
    for n in range(4):
        assert _errors(p, pre, f"seed{n}")[0]["code"] == "invalid_field"
        assert _errors(p, pre, f"wild{n}")[0]["code"] == "invalid_response_topic"
    slot = svc.synthesizers.slots["local"]
    assert slot.failures == 0 and slot.healthy
    assert _served(p, pre, "after-seed")["route"] == "local"


def test_4_response_topic_policy(daemons: DaemonFactory) -> None:
    svc = daemons.start(mqtt={"response_topic_prefix": "apps"})
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc, extra_topics=("apps/#", "other/#"))
    cases = {  # ResponseTopic -> refused?
        f"{pre}/tts/say": True,  # its own input: it would feed its answers back into itself
        f"{pre}/tts/cancel": True,
        "hermes/tts/say": True,
        "other/x": True,  # outside the allowed prefix
        "appsx/y": True,
        "apps/+": True,
        "apps/client-1": False,
        "apps": False,
    }
    for n, topic in enumerate(cases):
        p.publish(f"{pre}/tts/say", {"id": f"rt{n}", "text": "Hi.", "output": "publish"}, response_topic=topic)
    for n, (topic, refused) in enumerate(cases.items()):
        rid = f"rt{n}"
        end = p.wait_for(lambda m, r=rid: m.topic in (f"{pre}/tts/done/{r}", f"{pre}/tts/error/{r}"), 20)
        if refused:
            assert end.json()["code"] == "invalid_response_topic", topic
        else:
            assert end.topic.endswith(f"done/{rid}"), topic
            p.wait_for(lambda m, t=topic: m.topic == t and ("kind", "done") in m.user_properties, 10)
    time.sleep(0.3)
    assert len(p.on(f"{pre}/tts/say")) == len(cases)  # only the client's own requests: no feedback
    assert not p.on("other/x")


def _answer_ends(p: Recorder, pre: str, cases: dict[str, bool]) -> None:
    """Send one say per ResponseTopic; each ends with done (mirrored there) or invalid_response_topic."""
    for n, topic in enumerate(cases):
        p.publish(f"{pre}/tts/say", {"id": f"ns{n}", "text": "Hi.", "output": "publish"}, response_topic=topic)
    for n, (topic, refused) in enumerate(cases.items()):
        rid = f"ns{n}"
        end = p.wait_for(lambda m, r=rid: m.topic in (f"{pre}/tts/done/{r}", f"{pre}/tts/error/{r}"), 20)
        if refused:
            assert end.json()["code"] == "invalid_response_topic", topic
        else:
            assert end.topic.endswith(f"done/{rid}"), topic
            p.wait_for(lambda m, t=topic: m.topic == t and ("kind", "done") in m.user_properties, 10)


def test_4_the_namespaces_the_daemon_speaks_are_refused_by_default(daemons: DaemonFactory) -> None:
    svc = daemons.start()
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc, extra_topics=("hermes/#", f"{pre}/reply/#", f"{pre}/statusx"))
    cases = {  # ResponseTopic -> refused?
        "hermes/tts/sayFinished": True,  # the probe of issue 24: the done JSON posed as a Hermes answer
        "hermes/audioServer/x/playBytes/y": True,
        f"{pre}/status": True,
        f"{pre}/status/health": True,
        f"{pre}/statusx": False,
        f"{pre}/reply/client-1": False,
    }
    _answer_ends(p, pre, cases)
    time.sleep(0.3)
    assert not [m for m in p.messages if m.topic.startswith("hermes/")]  # nothing spoken as Hermes
    assert {m.payload for m in p.on(f"{pre}/status")} == {b"online"}


def test_4_the_allowed_prefix_may_open_a_reserved_namespace(daemons: DaemonFactory) -> None:
    svc = daemons.start(mqtt={"response_topic_prefix": "hermes/replies"})
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc, extra_topics=("hermes/#",))
    cases = {
        "hermes/replies/client-1": False,
        "hermes/tts/sayFinished": True,  # outside the allowed prefix
        "hermes/tts/say": True,  # an input topic
    }
    _answer_ends(p, pre, cases)
    assert not p.on("hermes/tts/sayFinished")


def test_5_undecodable_payloads_keep_a_leading_id(daemons: DaemonFactory) -> None:
    svc = daemons.start(mqtt={"max_payload_bytes": 4096})
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    p.publish(f"{pre}/tts/say", b'{"id": "tl1", "text": "' + b"a" * 5000 + b'"}')
    p.publish(f"{pre}/tts/say", b'{"id": "bj1", "text": "unterminated')
    p.publish(f"{pre}/tts/say", b'{"id": "bu1", "text": "\xc3\x28"}')
    assert _errors(p, pre, "tl1")[0] | {"message": ""} == {"id": "tl1", "code": "payload_too_large", "message": ""}
    assert _errors(p, pre, "bj1")[0]["code"] == "invalid_json"
    assert _errors(p, pre, "bu1")[0]["code"] == "invalid_utf8"


def test_5_hermes_answers_keep_the_id_and_only_for_its_own_site(daemons: DaemonFactory) -> None:
    svc = daemons.start(hermes={"site_ids": ["kitchen"], "output": "publish"})
    p = daemons.probe(svc, extra_topics=("hermes/#",))
    p.publish("hermes/tts/say", json.dumps({"siteId": "kitchen", "id": "hv1", "sessionId": "s9", "text": ""}))
    fin = p.wait_topic("hermes/tts/sayFinished").json()
    assert fin == {"id": "hv1", "siteId": "kitchen", "sessionId": "s9"}
    assert p.wait_topic("hermes/error/tts").json()["context"] == "hv1"
    p.publish("hermes/tts/say", b'{"siteId": "garage", "id": "not-ours", "text": ')  # broken, another site
    p.publish("hermes/tts/say", b'{"text": "no site", broken')  # broken, no siteId: "default", not ours
    p.publish("hermes/tts/say", b'{"siteId": "kitchen", "id": "hb2", "text": ')  # broken, ours
    p.wait_for(lambda _m: len(p.on("hermes/tts/sayFinished")) >= 2)
    time.sleep(0.5)
    finished = [m.json() for m in p.on("hermes/tts/sayFinished")]
    assert finished == [fin, {"id": "hb2", "siteId": "kitchen", "sessionId": None}]
    assert all(m.json()["siteId"] == "kitchen" for m in p.on("hermes/error/tts"))


def test_7_v5_packet_limit_keeps_huge_payloads_out(daemons: DaemonFactory) -> None:
    svc = daemons.start(mqtt={"max_payload_bytes": 65536})
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    received: list[int] = []
    inner = svc.intake.on_message
    svc.conn._on_message = lambda msg: (received.append(len(msg.payload)), inner(msg))  # type: ignore[assignment]
    limit = max_packet_bytes(65536)
    p.publish(f"{pre}/tts/say", b'{"id": "huge", "text": "' + b"a" * (limit + 10) + b'"}')
    p.publish(f"{pre}/tts/say", b'{"id": "edge", "text": "' + b"a" * 70_000 + b'"}')
    assert _errors(p, pre, "edge")[0]["code"] == "payload_too_large"
    time.sleep(0.3)
    assert not p.on(f"{pre}/tts/error/huge") and max(received) < limit  # the broker never sent it
    assert svc.conn.connected.is_set() and _served(p, pre, "after-huge")["reason"] == "completed"


def test_7_private_broker_sets_max_packet_size() -> None:
    require_binary("mosquitto", "apt-get install mosquitto")
    from tests.support.broker import free_port

    broker = LocalBroker(free_port(), max_packet_bytes=123456)
    broker.start()
    try:
        assert broker._dir is not None
        conf = (__import__("pathlib").Path(broker._dir.name) / "mosquitto.conf").read_text()
        assert "max_packet_size 123456\n" in conf
    finally:
        broker.stop()


def test_7_a_huge_voice_is_not_echoed(daemons: DaemonFactory, caplog: pytest.LogCaptureFixture) -> None:
    svc = daemons.start()
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    with caplog.at_level(logging.INFO):
        p.publish(f"{pre}/tts/say", {"id": "hv", "text": "x", "voice": "v" * 100_000, "mode": "m" * 100_000})
        err = _errors(p, pre, "hv")[0]
    assert err["code"] == "unknown_mode" and len(err["message"]) < 500
    p.publish(f"{pre}/tts/say", {"id": "hv2", "text": "x", "voice": "v" * 100_000})
    assert len(_errors(p, pre, "hv2")[0]["message"]) < 500
    assert max(len(r.getMessage()) for r in caplog.records) < 1000
