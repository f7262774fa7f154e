"""The one MQTT client factory against a real Mosquitto: broker URLs, the
persistent v5 session, v3.1.1, TCP_NODELAY, the last will and credentials
from a password file."""

from __future__ import annotations

import queue
import socket
import threading
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from cosyedge_cloud.wire.mqtt import (
    MqttOptions,
    MqttSetupError,
    connect,
    make_client,
    parse_broker_url,
    publish_properties,
)

from tests.cloud_bridge.conftest import USERS
from tests.support.broker import Broker


def test_broker_urls() -> None:
    a = parse_broker_url("mqtts://u:p@host")
    assert (a.host, a.port, a.tls, a.username, a.password) == ("host", 8883, True, "u", "p")
    assert parse_broker_url("localhost:1999").port == 1999 and not parse_broker_url("localhost").tls
    assert parse_broker_url("mqtt://[::1]:1884").host == "::1"
    for bad in ("http://x", "mqtt://h:0", "mqtt://h:70000", ""):
        with pytest.raises(MqttSetupError, match="broker = "):
            parse_broker_url(bad)
    with pytest.raises(MqttSetupError, match="protocol"):
        make_client(MqttOptions(broker="mqtt://h", protocol="4"))  # type: ignore[arg-type]
    with pytest.raises(MqttSetupError, match="password_file '/nonexistent/pw' cannot be read"):
        make_client(MqttOptions(broker="mqtt://h", username="u", password_file="/nonexistent/pw"))


class _Conn:
    """A factory-made client connected and looping; records connects and messages."""

    def __init__(self, opts: MqttOptions, subscribe: str = "") -> None:
        self.opts = opts
        self.connacks: queue.Queue[tuple[bool, bool]] = queue.Queue()  # (refused, session present)
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.subscribed = threading.Event()
        self.client = make_client(opts)
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda _c, _u, msg: self.messages.put(msg)
        self.client.on_subscribe = lambda *_a: self.subscribed.set()
        self._topic = subscribe
        connect(self.client, opts)
        self.client.loop_start()

    def _on_connect(self, client: mqtt.Client, _u: Any, flags: Any, reason: Any, _p: Any) -> None:
        self.connacks.put((reason.is_failure, bool(flags.session_present)))
        if not reason.is_failure and self._topic:
            client.subscribe(self._topic, qos=1)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_persistent_session_nodelay_and_round_trip(broker: Broker, protocol: str) -> None:
    opts = MqttOptions(broker=broker.url, client_id=f"factory-{protocol}", protocol=protocol,  # type: ignore[arg-type]
                       session_expiry_s=300)
    first = _Conn(opts, subscribe="factory/t")
    try:
        assert first.connacks.get(timeout=10) == (False, False)
        assert first.subscribed.wait(10)
        sock = first.client.socket()
        assert isinstance(sock, socket.socket) and sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        first.close()
    # the session outlives the connection: queued QoS 1 messages wait for the client
    sender = _Conn(MqttOptions(broker=broker.url, protocol=protocol))  # type: ignore[arg-type]
    props = publish_properties(user_properties=[("k", "v")]) if protocol == "5" else None
    sender.client.publish("factory/t", b"while away", qos=1, properties=props).wait_for_publish(5)
    sender.close()
    again = _Conn(opts)
    try:
        assert again.connacks.get(timeout=10) == (False, True)
        msg = again.messages.get(timeout=10)
        assert msg.payload == b"while away"
        if protocol == "5":
            assert msg.properties.UserProperty == [("k", "v")]  # type: ignore[union-attr]
    finally:
        again.close()
    clean = _Conn(MqttOptions(broker=broker.url, client_id=f"factory-{protocol}", protocol=protocol))  # type: ignore[arg-type]
    try:
        assert clean.connacks.get(timeout=10) == (False, False)  # None: a clean session
    finally:
        clean.close()


def test_last_will_on_an_unclean_disconnect(broker: Broker) -> None:
    watcher = _Conn(MqttOptions(broker=broker.url), subscribe="factory/status")
    assert watcher.subscribed.wait(10)
    dev = _Conn(MqttOptions(broker=broker.url, client_id="willing", will_topic="factory/status",
                            will_payload=b"offline", will_retain=False))
    try:
        assert dev.connacks.get(timeout=10)[0] is False
        dev.client.loop_stop()
        sock = dev.client.socket()
        assert isinstance(sock, socket.socket)
        sock.close()  # no DISCONNECT packet: the broker sends the will
        assert watcher.messages.get(timeout=10).payload == b"offline"
    finally:
        watcher.close()


def test_password_file_credentials(cloud_broker: Broker, tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text(USERS["devA"] + "\n")
    good = _Conn(MqttOptions(broker=cloud_broker.url, client_id="devA-1", username="devA", password_file=str(pw)))
    bad = _Conn(MqttOptions(broker=cloud_broker.url, client_id="devA-2", username="devA", password="wrong"))
    try:
        assert good.connacks.get(timeout=10) == (False, False)
        assert bad.connacks.get(timeout=10)[0] is True
    finally:
        good.close()
        bad.close()
