"""A device's side of the cloud protocol for tests: a paho MQTT v5 client
that publishes requests on its own request topic and collects the responses
per request id (what the daemon's CloudSynthesizer will do)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from cosyedge_cloud.wire.mqtt import MqttOptions, connect, make_client
from cosyedge_cloud.wire.protocol import (
    AudioMessage,
    CloudRequest,
    CloudTopics,
    DoneMessage,
    ErrorMessage,
    ResponseMessage,
    decode_response,
)
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


@dataclass
class Answer:
    audio: list[AudioMessage] = field(default_factory=list)
    done: DoneMessage | None = None
    error: ErrorMessage | None = None
    raw: list[ResponseMessage] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)

    def pcm(self) -> Any:
        import numpy as np

        return np.concatenate([a.pcm() for a in self.audio]) if self.audio else np.zeros(0, np.float32)


class Device:
    def __init__(
        self,
        broker_url: str,
        device_id: str,
        *,
        username: str | None = None,
        password: str | None = None,
        client_id: str | None = None,
        protocol: int = mqtt.MQTTv5,
        clean: bool = True,
        subscribe: bool = True,
        topics: CloudTopics | None = None,
    ) -> None:
        self.device_id = device_id
        self.topics = topics or CloudTopics()
        self.protocol = protocol
        self.answers: dict[str, Answer] = {}
        self.stray: list[tuple[str, bytes]] = []
        self.sub_results: list[Any] = []
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self._subscribe_own = subscribe
        self.refused: str | None = None
        opts = MqttOptions(
            broker=broker_url, client_id=client_id or f"dev-{device_id}-{time.monotonic_ns()}",
            protocol="5" if protocol == mqtt.MQTTv5 else "3.1.1", username=username or "",
            password=password or "", session_expiry_s=None if clean else 3600,
        )
        self.client = make_client(opts)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        connect(self.client, opts)
        self.client.loop_start()
        if not self._connected.wait(10):
            self.client.loop_stop()
            raise TimeoutError(f"device {device_id} did not connect")
        if self.refused is not None:
            self.client.loop_stop()
            raise ConnectionRefusedError(f"device {device_id}: {self.refused}")
        if subscribe and not self._subscribed.wait(10):
            raise TimeoutError(f"device {device_id} did not subscribe")

    def _on_connect(self, client: mqtt.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            self.refused = str(reason)
        self._connected.set()
        if not reason.is_failure and self._subscribe_own:
            client.subscribe(self.topics.response_filter(self.device_id), qos=1)

    def _on_subscribe(self, _c: mqtt.Client, _u: Any, _mid: int, reasons: list[Any], _p: Any) -> None:
        self.sub_results.append(reasons)
        self._subscribed.set()

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        rid = self.topics.request_of_response(self.device_id, msg.topic)
        if rid is None:
            with self._lock:
                self.stray.append((msg.topic, msg.payload))
            return
        props = getattr(msg, "properties", None)
        user = getattr(props, "UserProperty", None) if props is not None else None
        message = decode_response(msg.payload, user, rid)
        with self._lock:
            answer = self.answers.setdefault(rid, Answer())
            answer.raw.append(message)
            if isinstance(message, AudioMessage):
                answer.audio.append(message)
            elif isinstance(message, DoneMessage):
                answer.done = message
                answer.finished.set()
            else:
                answer.error = message
                answer.finished.set()

    def subscribe(self, topic: str, timeout_s: float = 5.0) -> list[Any]:
        """Subscribe to any filter; returns the broker's reason codes."""
        self._subscribed.clear()
        self.client.subscribe(topic, qos=1)
        self._subscribed.wait(timeout_s)
        return self.sub_results[-1]

    def send(
        self,
        request: CloudRequest | bytes,
        *,
        request_id: str | None = None,
        expiry_s: int | None = None,
        topic: str | None = None,
    ) -> Answer:
        payload = request.to_json() if isinstance(request, CloudRequest) else request
        rid = request.id if isinstance(request, CloudRequest) else (request_id or "_")
        with self._lock:
            answer = self.answers.setdefault(rid, Answer())
        props = None
        if self.protocol == mqtt.MQTTv5 and expiry_s is not None:
            props = Properties(PacketTypes.PUBLISH)
            props.MessageExpiryInterval = expiry_s
        info = self.client.publish(topic or self.topics.request(self.device_id), payload, qos=1, properties=props)
        info.wait_for_publish(5)
        return answer

    def ask(self, request: CloudRequest, timeout_s: float = 30.0, **kw: Any) -> Answer:
        answer = self.send(request, **kw)
        if not answer.finished.wait(timeout_s):
            raise TimeoutError(
                f"no done/error for {request.id} within {timeout_s} s ({len(answer.audio)} chunks so far)"
            )
        return answer

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
