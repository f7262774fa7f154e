"""The daemon's MQTT connection (paho-mqtt 2.x, VERSION2 callbacks): a fixed
client id with a persistent session, retained online/offline status with
the offline last will, subscriptions made in on_connect (so they survive
reconnects); TLS, credentials, TCP_NODELAY and the session come from the
one MQTT client factory. Callbacks only wrap the message and hand it to
`on_message`, which must only parse and queue."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from cosyedge_cloud.wire.mqtt import MqttOptions, connect, make_client, received_properties
from cosyedge_daemon.settings.loader import parse_broker_url
from cosyedge_daemon.settings.schema import DeviceMqttSettings
from cosyedge_daemon.settings.topics import topic_problem
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

log = logging.getLogger(__name__)

ONLINE, OFFLINE = b"online", b"offline"
_MAX_OFFLINE_QUEUE = 2000  # publishes paho keeps while disconnected; beyond it they are dropped
# Room above max_payload_bytes for the topic and properties: payloads up to this
# size arrive and get payload_too_large; a v5 broker never sends larger ones.
PACKET_HEADROOM_BYTES = 65_536
MQTT_MAX_PACKET_BYTES = 268_435_455


def max_packet_bytes(max_payload_bytes: int) -> int:
    """The MaximumPacketSize the daemon announces (MQTT v5) and its private broker sets."""
    return min(max_payload_bytes + PACKET_HEADROOM_BYTES, MQTT_MAX_PACKET_BYTES)


@dataclass(frozen=True)
class InboundMessage:
    topic: str
    payload: bytes
    response_topic: str | None = None
    correlation_data: bytes | None = None
    received_at: float = 0.0  # time.monotonic()
    user_properties: tuple[tuple[str, str], ...] = ()  # MQTT v5


@dataclass(frozen=True)
class Reply:
    """Where a v5 requester wants copies of the answers."""

    topic: str
    correlation_data: bytes | None


def mqtt_options(settings: DeviceMqttSettings, client_id: str, status_topic: str) -> MqttOptions:
    """The daemon's connection: a persistent session and the retained offline will."""
    s = settings
    return s.options(
        client_id, protocol="5" if s.protocol == "5" else "3.1.1",
        reconnect_min_delay_s=s.reconnect_min_delay_s, reconnect_max_delay_s=s.reconnect_max_delay_s,
        will_topic=status_topic, will_payload=OFFLINE, max_queued_messages=_MAX_OFFLINE_QUEUE,
        # v5: the broker drops (for us) what is larger, instead of making us read it into memory.
        max_packet_size=max_packet_bytes(s.max_payload_bytes),
    )


class MqttConnection:
    def __init__(
        self,
        settings: DeviceMqttSettings,
        client_id: str,
        status_topic: str,
        subscriptions: Sequence[str],
        on_message: Callable[[InboundMessage], None],
        on_connected: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.address = parse_broker_url(settings.broker)
        self.status_topic = status_topic
        self.subscriptions = list(subscriptions)
        self.v5 = settings.protocol == "5"
        self.connected = threading.Event()
        self.connect_count = 0
        self._subscribe_mid: int | None = None
        self._on_message = on_message
        self._on_connected = on_connected
        self.options = mqtt_options(settings, client_id, status_topic)
        self.client = make_client(self.options)
        self._configure()

    def _configure(self) -> None:
        c = self.client
        c.on_connect = self._handle_connect
        c.on_subscribe = self._handle_subscribe
        c.on_disconnect = self._handle_disconnect
        c.on_message = self._handle_message

    def start(self) -> None:
        """Connect in the background; paho's loop thread reconnects with backoff."""
        connect(self.client, self.options, background=True)
        self.client.loop_start()

    def wait_connected(self, timeout_s: float) -> bool:
        return self.connected.wait(timeout_s)

    def _handle_connect(self, client: mqtt.Client, _u: Any, _flags: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            log.warning(
                "broker %s:%d refused the connection: %s", self.address.host, self.address.port, reason
            )
            return
        self.connect_count += 1
        log.info("connected to %s:%d (MQTT %s)", self.address.host, self.address.port, self.settings.protocol)
        # "online" (and `connected`) only once the broker confirmed the
        # subscriptions: a request sent before that would be lost.
        _rc, self._subscribe_mid = client.subscribe([(t, self.settings.qos) for t in self.subscriptions])

    def _handle_subscribe(self, client: mqtt.Client, _u: Any, mid: int, reasons: Any, _p: Any) -> None:
        if mid != self._subscribe_mid:
            return
        refused = [str(r) for r in reasons if r.is_failure]
        if refused:
            log.error("the broker refused subscriptions (%s); check its ACLs for %s", ", ".join(refused),
                      self.subscriptions)
        client.publish(self.status_topic, ONLINE, qos=1, retain=True)
        self.connected.set()
        if self._on_connected is not None:
            self._on_connected()

    def _handle_disconnect(self, _c: mqtt.Client, _u: Any, _flags: Any, reason: Any, _p: Any) -> None:
        if self.connected.is_set():
            log.warning("disconnected from the broker (%s); reconnecting", reason)
        self.connected.clear()

    def _handle_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        props = received_properties(msg)
        response_topic, correlation = props.response_topic, props.correlation_data
        user_props = tuple(props.user_properties)
        try:
            self._on_message(
                InboundMessage(
                    msg.topic,
                    bytes(msg.payload),
                    response_topic or None,
                    correlation,
                    time.monotonic(),
                    user_props,
                )
            )
        except Exception:  # a bug in a handler must not kill paho's network thread
            log.exception("handling a message on %s failed", msg.topic)

    def publish(
        self,
        topic: str,
        payload: bytes | str,
        *,
        retain: bool = False,
        user_properties: Iterable[tuple[str, str]] = (),
        correlation_data: bytes | None = None,
        content_type: str | None = None,
        qos: int | None = None,
        message_expiry_s: int | None = None,
    ) -> mqtt.MQTTMessageInfo | None:
        """Queue a publish; None (logged) for a topic the broker would take as a
        malformed packet: one bad topic must never cost the connection."""
        why = topic_problem(topic)
        if why is not None:
            log.error("not publishing on topic %r: %s", topic[:200], why)
            return None
        props = None
        if self.v5:
            props = Properties(PacketTypes.PUBLISH)
            if message_expiry_s is not None:
                props.MessageExpiryInterval = message_expiry_s
            pairs = list(user_properties)
            if pairs:
                props.UserProperty = pairs
            if correlation_data is not None:
                props.CorrelationData = correlation_data
            if content_type:
                props.ContentType = content_type
        info = self.client.publish(
            topic, payload, qos=self.settings.qos if qos is None else qos, retain=retain, properties=props
        )
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            log.warning("publish on %s failed: %s", topic, mqtt.error_string(info.rc))
        return info

    def stop(self, timeout_s: float = 2.0) -> None:
        """Publish the retained offline status (the will only fires on an
        unclean disconnect), then disconnect."""
        if self.connected.is_set():
            info = self.client.publish(self.status_topic, OFFLINE, qos=1, retain=True)
            try:
                info.wait_for_publish(timeout_s)
            except (RuntimeError, ValueError) as exc:
                log.warning("offline status not confirmed: %s", exc)
        self.connected.clear()  # an intended disconnect: no reconnect warning
        self.client.disconnect()
        self.client.loop_stop()
