"""The device's CloudSynthesizer on a real Mosquitto, against a scripted peer in
the bridge's place (the real bridge and Triton are in
tests/cloud_bridge/bridge/test_e2e_*.py): what it sends, redelivery, errors,
timeouts, the link topic."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from cosyedge_cloud.wire.mqtt import MqttOptions, connect, make_client, publish_properties, received_properties
from cosyedge_cloud.wire.protocol import CloudTopics, encode_audio, encode_done, encode_error, parse_request
from cosyedge_daemon.mqtt.connection import MqttConnection
from cosyedge_daemon.settings.schema import CloudSettings, DeviceMqttSettings
from cosyedge_daemon.synthesizers.cloud import CloudSynthesizer, CloudUnavailable
from cosyedge_models.errors import RequestError
from cosyedge_models.synthesis.api import SynthesisRequest

from tests.support.broker import Broker

Script = Callable[["Peer", str, Any], None]


class Peer:
    """Takes the bridge's place: records requests (payload and expiry) and
    answers them with `script`."""

    def __init__(self, broker: Broker, script: Script) -> None:
        self.topics = CloudTopics()
        self.script = script
        self.requests: list[tuple[dict[str, Any], int | None]] = []
        opts = MqttOptions(broker=broker.url, client_id=f"peer-{uuid.uuid4().hex[:6]}")
        self.client = make_client(opts)
        self.client.on_message = self._on_message
        ready = threading.Event()
        self.client.on_subscribe = lambda *a: ready.set()
        connect(self.client, opts)
        self.client.subscribe(self.topics.request_filter(), qos=1)
        self.client.loop_start()
        assert ready.wait(10)

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        device = self.topics.device_of_request(msg.topic)
        request = parse_request(msg.payload)
        expiry = received_properties(msg).message_expiry_s
        self.requests.append((json.loads(msg.payload), expiry))
        assert device is not None
        threading.Thread(target=self.script, args=(self, device, request), daemon=True).start()

    def send(self, device: str, rid: str, payload: bytes, props: list[tuple[str, str]]) -> None:
        p = publish_properties(user_properties=props)
        self.client.publish(self.topics.response(device, rid), payload, qos=1, properties=p)

    def audio(self, device: str, rid: str, seq: int, last: bool, value: float = 0.1) -> None:
        self.send(device, rid, *encode_audio(rid, np.full(240, value, np.float32), 24000, seq, last, "1", False))

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture()
def conn(broker: Broker) -> Iterator[MqttConnection]:
    device = f"d{uuid.uuid4().hex[:6]}"
    c = MqttConnection(DeviceMqttSettings(broker=broker.url), f"cosyedge-{device}", f"cosyedge/{device}/status", [],
                       on_message=lambda m: None)
    c.device = device  # type: ignore[attr-defined]
    yield c
    c.stop()


def start(conn: MqttConnection, **settings: Any) -> CloudSynthesizer:
    engine = CloudSynthesizer(conn, conn.device, CloudSettings(enabled=True, **settings))  # type: ignore[attr-defined]
    conn.subscriptions = engine.subscriptions()
    conn._on_message = engine.on_message  # the Service routes cloud topics like this
    conn.start()
    assert conn.wait_connected(10)
    return engine


def run(engine: CloudSynthesizer, text: str = "hello", **kw: Any) -> list[Any]:
    return list(engine.synthesize(SynthesisRequest(text=text), **kw))


def test_streams_chunks_with_seed_and_expiry(broker: Broker, conn: MqttConnection) -> None:
    def script(peer: Peer, device: str, req: Any) -> None:
        for seq in range(3):
            peer.audio(device, req.id, seq, seq == 2)
        peer.send(device, req.id, *encode_done(req.id, {"chunks": 3}))

    peer = Peer(broker, script)
    try:
        engine = start(conn)
        deadline_at = time.monotonic() + 8.0
        chunks = run(engine, request_id="job-1", deadline_at=deadline_at)
        assert [c.index for c in chunks] == [0, 1, 2] and chunks[-1].last
        assert chunks[0].sample_rate == 24000 and abs(float(chunks[0].pcm[0]) - 0.1) < 1e-3
        doc, expiry = peer.requests[0]
        assert doc["id"] == "job-1" and isinstance(doc["seed"], int)
        assert expiry is not None and 7 <= expiry <= 8  # from the deadline
        assert doc["deadline_unix_ms"] > time.time() * 1000
        run(engine)
        assert isinstance(peer.requests[1][0]["seed"], int) and peer.requests[1][1] == 60  # request_expiry_s
    finally:
        peer.close()


def test_redelivered_request_chunks_are_skipped(broker: Broker, conn: MqttConnection) -> None:
    def script(peer: Peer, device: str, req: Any) -> None:
        peer.audio(device, req.id, 0, False, 0.1)
        peer.audio(device, req.id, 1, False, 0.2)
        # the bridge crashed and the request came again: from the start, same seed
        for seq, value in enumerate((0.1, 0.2, 0.3, 0.4)):
            peer.audio(device, req.id, seq, seq == 3, value)

    peer = Peer(broker, script)
    try:
        chunks = run(start(conn))
        assert [c.index for c in chunks] == [0, 1, 2, 3]
        assert [round(float(c.pcm[0]), 1) for c in chunks] == [0.1, 0.2, 0.3, 0.4]
    finally:
        peer.close()


def test_errors_fall_back_or_reach_the_client(broker: Broker, conn: MqttConnection) -> None:
    def script(peer: Peer, device: str, req: Any) -> None:
        code = req.text
        if code == "midway":
            peer.audio(device, req.id, 0, False)
            code = "timeout"
        peer.send(device, req.id, *encode_error(req.id, code, f"{code} happened"))

    peer = Peer(broker, script)
    try:
        engine = start(conn)
        for code in ("busy", "unavailable", "model_error", "deadline_exceeded"):
            with pytest.raises(CloudUnavailable, match=code):
                run(engine, code)
        with pytest.raises(RequestError) as err:
            run(engine, "unknown_voice")
        assert err.value.code == "unknown_voice"
        got: list[Any] = []
        with pytest.raises(CloudUnavailable, match="timeout"):
            for chunk in engine.synthesize(SynthesisRequest(text="midway")):
                got.append(chunk)
        assert len(got) == 1
    finally:
        peer.close()


def test_no_first_chunk_in_time_and_stall(broker: Broker, conn: MqttConnection) -> None:
    def script(peer: Peer, device: str, req: Any) -> None:
        if req.text == "stall":
            peer.audio(device, req.id, 0, False)

    peer = Peer(broker, script)
    try:
        engine = start(conn, first_chunk_timeout_s=0.5, chunk_timeout_s=0.4)
        with pytest.raises(CloudUnavailable, match="no audio from the cloud within 500 ms"):
            run(engine, "silence")
        # the deadline is nearer than the timeout: the wait it reports is the deadline's (at most 200 ms)
        with pytest.raises(CloudUnavailable, match="no audio") as info:
            run(engine, "silence", deadline_at=time.monotonic() + 0.2)
        waited_ms = re.search(r"within (\d+) ms", str(info.value))
        assert waited_ms is not None and int(waited_ms.group(1)) <= 200, info.value
        with pytest.raises(CloudUnavailable, match="stalled after 1 chunks"):
            run(engine, "stall")
        # cancelled while waiting for the first chunk: ends quietly (not the 500 ms timeout's error)
        cancel = threading.Event()
        cancel.set()
        assert run(engine, "silence", cancel=cancel) == []
        # a chunk of a request that is no longer waiting is dropped
        peer.audio(conn.device, "gone", 0, True)  # type: ignore[attr-defined]
    finally:
        peer.close()


def test_link_topic_and_connection_health(broker: Broker, conn: MqttConnection) -> None:
    engine = start(conn)
    assert engine.available() and engine.link_up is None
    link = CloudTopics().link(conn.device)  # type: ignore[attr-defined]
    conn.publish(link, b"0", retain=True)
    deadline = time.monotonic() + 5
    while engine.available() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.available() and engine.link_up is False
    with pytest.raises(CloudUnavailable, match="link"):
        run(engine)
    conn.publish(link, b"1", retain=True)
    deadline = time.monotonic() + 5
    while not engine.available() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.available()
    conn.publish(link, b"", retain=True)  # clear the retained state
    broker.stop()
    deadline = time.monotonic() + 5
    while engine.available() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.available()
    with pytest.raises(CloudUnavailable, match="broker"):
        run(engine)


def test_service_wires_the_cloud_and_reloads_its_live_settings(daemons) -> None:  # type: ignore[no-untyped-def]
    from tests.daemon.conftest import with_section

    svc = daemons.start(cloud={"enabled": True})
    assert svc.cloud is not None and svc.synthesizers.slots["cloud"].engine is svc.cloud
    assert set(svc.cloud.subscriptions()) <= set(svc.conn.subscriptions)
    new = with_section(svc.settings, "cloud", first_chunk_timeout_s=2.5, enabled=False)
    new = with_section(new, "routing", cloud_min_chars=12)
    restart = svc.apply_settings(new)
    assert restart == ["[cloud] enabled"]  # the engine itself is made at start
    assert svc.cloud.settings.first_chunk_timeout_s == 2.5 and svc.router.settings.cloud_min_chars == 12
    plain = daemons.start()
    assert plain.cloud is None and plain.synthesizers.slots["cloud"].engine is None
