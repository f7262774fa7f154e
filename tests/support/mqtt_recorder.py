"""A test client on the real broker: publishes requests and records every
message it receives (with v5 properties) for assertions."""

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
    def __init__(self, broker_url: str, topics: list[str], protocol: str = "5") -> None:
        self.v5 = protocol == "5"
        opts = MqttOptions(
            broker=broker_url, client_id=f"probe-{uuid.uuid4().hex[:8]}", protocol="5" if self.v5 else "3.1.1"
        )
        self.client = make_client(opts)
        self.messages: list[Received] = []
        self._cond = threading.Condition()
        self._subscribed = threading.Event()
        self.topics = topics
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        connect(self.client, opts)
        self.client.loop_start()
        if not self._subscribed.wait(10):
            raise TimeoutError("probe did not subscribe")

    def _on_connect(self, client: mqtt.Client, *_: Any) -> None:
        client.subscribe([(t, 1) for t in self.topics])

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
        with self._cond:
            self.messages.append(rec)
            self._cond.notify_all()

    def publish(
        self,
        topic: str,
        payload: bytes | str | dict[str, Any],
        *,
        response_topic: str | None = None,
        correlation: bytes | None = None,
        qos: int = 1,
    ) -> float:
        if isinstance(payload, dict):
            payload = json.dumps(payload)
        props = None
        if self.v5 and (response_topic or correlation):
            props = Properties(PacketTypes.PUBLISH)
            if response_topic:
                props.ResponseTopic = response_topic
            if correlation:
                props.CorrelationData = correlation
        t = time.monotonic()
        self.client.publish(topic, payload, qos=qos, properties=props).wait_for_publish(5)
        return t

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

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
