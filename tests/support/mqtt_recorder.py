"""The tests' one MQTT client on the real broker (made by the product's
factory, cosyedge_cloud.wire.mqtt): it subscribes, records every message it
receives (with v5 properties) for assertions, publishes requests, and lets a
test wait on what arrived (no sleeps). Options for the other uses:
credentials (ACL tests), a persistent session that survives broker restarts,
an `on_message` hook and `keep=False` for long runs that only count."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from cosyedge_cloud.wire.mqtt import MqttOptions, connect, make_client
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


@dataclass
class Received:
    topic: str
    payload: bytes
    retain: bool
    user_properties: list[tuple[str, str]] = field(default_factory=list)
    correlation_data: bytes | None = None
    at: float = 0.0

    def json(self) -> Any:
        return json.loads(self.payload)


class Recorder:
    def __init__(
        self,
        broker_url: str,
        topics: list[str],
        protocol: str = "5",
        *,
        username: str = "",
        password: str = "",
        session_expiry_s: int | None = None,
        on_message: Callable[[Received], None] | None = None,
        keep: bool = True,
        name: str = "probe",
    ) -> None:
        """Connect and subscribe to `topics` (QoS 1); raises when the broker
        refuses the login or the subscription does not come back in 10 s.
        With `session_expiry_s` the session persists: after a reconnect with
        the session present the broker still has the subscriptions."""
        self.v5 = protocol == "5"
        opts = MqttOptions(
            broker=broker_url, client_id=f"{name}-{uuid.uuid4().hex[:8]}", protocol="5" if self.v5 else "3.1.1",
            username=username, password=password, session_expiry_s=session_expiry_s,
            reconnect_min_delay_s=0.1, reconnect_max_delay_s=1.0,
        )
        self.client = make_client(opts)
        self.messages: list[Received] = []
        self.hook = on_message
        self.keep = keep
        self.refused: str | None = None
        self._cond = threading.Condition()
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self.topics = topics
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        connect(self.client, opts)
        self.client.loop_start()
        if not self._connected.wait(10):
            self.close()
            raise TimeoutError(f"{name} did not connect")
        if self.refused is not None:
            self.close()
            raise ConnectionRefusedError(f"{name}: {self.refused}")
        if topics and not self._subscribed.wait(10):
            self.close()
            raise TimeoutError(f"{name} did not subscribe")

    def _on_connect(self, client: mqtt.Client, _u: Any, flags: Any, reason: Any, _p: Any = None) -> None:
        if reason.is_failure:
            self.refused = str(reason)
        elif self.topics and not flags.session_present:
            client.subscribe([(t, 1) for t in self.topics])
        elif self.topics:
            self._subscribed.set()
        self._connected.set()
        with self._cond:
            self._cond.notify_all()

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        props = getattr(msg, "properties", None)
        rec = Received(
            msg.topic,
            bytes(msg.payload),
            bool(msg.retain),
            list(getattr(props, "UserProperty", []) or []),
            getattr(props, "CorrelationData", None),
            time.monotonic(),
        )
        with self._cond:  # the hook under the lock: a test's wait predicate reads what it counts
            if self.hook is not None:
                self.hook(rec)
            if self.keep:
                self.messages.append(rec)
            self._cond.notify_all()

    def publish(
        self,
        topic: str,
        payload: bytes | str | dict[str, Any],
        *,
        response_topic: str | None = None,
        correlation: bytes | None = None,
        properties: Properties | None = None,
        qos: int = 1,
    ) -> float:
        """Publish and wait until the broker has it; returns when it was sent
        (time.monotonic). `properties` replaces the ones built here."""
        if isinstance(payload, dict):
            payload = json.dumps(payload)
        props = properties
        if props is None and self.v5 and (response_topic or correlation):
            props = Properties(PacketTypes.PUBLISH)
            if response_topic:
                props.ResponseTopic = response_topic
            if correlation:
                props.CorrelationData = correlation
        t = time.monotonic()
        self.client.publish(topic, payload, qos=qos, properties=props).wait_for_publish(10)
        return t

    def wait(self, predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
        """Wait until `predicate()` holds (checked whenever a message or a
        connect arrives); False after `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout_s)

    def wait_for(self, pred: Callable[[Received], bool], timeout_s: float = 20.0) -> Received:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for m in self.messages:
                    if pred(m):
                        return m
                left = deadline - time.monotonic()
                if left <= 0:
                    topics = [m.topic for m in self.messages][-20:]
                    raise TimeoutError(f"no matching message in {timeout_s} s; last topics: {topics}")
                self._cond.wait(left)

    def wait_topic(self, topic: str, timeout_s: float = 20.0) -> Received:
        return self.wait_for(lambda m: m.topic == topic, timeout_s)

    def on(self, topic: str) -> list[Received]:
        with self._cond:
            return [m for m in self.messages if m.topic == topic]

    def payloads(self) -> set[bytes]:
        with self._cond:
            return {m.payload for m in self.messages}

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
