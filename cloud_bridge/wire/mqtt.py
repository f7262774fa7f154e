"""The one MQTT client factory: every cosyedge client (the daemon, `cosyedge
say`, the MQTT bench, the cloud bridge, the probe, the load test and the
tests' stand-ins for devices and apps) gets its paho client here, so broker
URLs, TLS, credentials (incl. a password file), TCP_NODELAY, MQTT v5
sessions and properties (or v3.1.1), reconnect delays and the last will are
set up one way.

Imports only paho, the standard library, cosyedge_models.errors and cosyedge_cloud.wire.net
(both sides of the wire use it)."""

from __future__ import annotations

import re
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import paho.mqtt.client as mqtt
from cosyedge_cloud.wire.net import set_nodelay
from cosyedge_models.errors import CosyEdgeError
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

Protocol = Literal["5", "3.1.1"]
UserProperties = Iterable[tuple[str, str]]

_URL_RE = re.compile(
    r"^(?:(mqtts?|tcp|ssl)://)?(?:([^:@/]*)(?::([^@/]*))?@)?(\[[^\]]+\]|[^:/]+)(?::(\d+))?/?$"
)


class MqttSetupError(CosyEdgeError, ValueError):
    """A broker URL, credential or TLS file that cannot be used."""


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool
    username: str = ""
    password: str = ""


def parse_broker_url(url: str) -> BrokerAddress:
    """mqtt://[user[:pass]@]host[:port] or mqtts://… (tcp:// and ssl:// too); a bare
    host[:port] means mqtt://. Default ports: 1883, with TLS 8883."""
    m = _URL_RE.match(url.strip())
    if not m:
        raise MqttSetupError(f"broker = {url!r}: expected mqtt://host[:port] or mqtts://host[:port]")
    scheme, user, password, host, port = m.groups()
    tls = scheme in ("mqtts", "ssl")
    port_n = int(port) if port else (8883 if tls else 1883)
    if not 0 < port_n < 65536:
        raise MqttSetupError(f"broker = {url!r}: port must be between 1 and 65535")
    return BrokerAddress(host.strip("[]"), port_n, tls, user or "", password or "")


@dataclass(frozen=True)
class MqttOptions:
    """How one client reaches the broker. Credentials: `username`/`password`
    win over those in the URL; `password_file` (its first line) over both
    passwords. `session_expiry_s`: None for a clean session that ends with
    the connection; a number for a persistent session (v5: clean start off
    and the broker keeps it this long; v3.1.1: clean session off)."""

    broker: str
    client_id: str = ""  # empty: the broker assigns one (clean sessions only)
    protocol: Protocol = "5"
    username: str = ""
    password: str = ""
    password_file: str = ""
    tls_ca_file: str = ""  # empty: the system CAs
    tls_cert_file: str = ""  # client certificate (mutual TLS)
    tls_key_file: str = ""
    tls_insecure: bool = False  # skip the host name check (testing only)
    keepalive_s: int = 30
    session_expiry_s: int | None = None
    receive_maximum: int | None = None  # v5: at most this many QoS>0 messages in flight to us
    reconnect_min_delay_s: float = 1.0
    reconnect_max_delay_s: float = 30.0
    will_topic: str = ""  # empty: no last will
    will_payload: bytes = b""
    will_qos: int = 1
    will_retain: bool = True
    manual_ack: bool = False  # acknowledge QoS>0 deliveries with client.ack (after handling them)
    max_queued_messages: int = 0  # publishes kept while disconnected; 0: unbounded
    max_packet_size: int | None = None  # v5: the broker sends us no larger packet (it drops it for us)

    @property
    def address(self) -> BrokerAddress:
        return parse_broker_url(self.broker)

    @property
    def v5(self) -> bool:
        return self.protocol == "5"


def read_password_file(path: str) -> str:
    try:
        return Path(path).read_text().splitlines()[0]
    except (OSError, IndexError) as exc:
        raise MqttSetupError(f"password_file {path!r} cannot be read: {exc}") from None


def make_client(opts: MqttOptions) -> mqtt.Client:
    """A configured, unconnected paho client (VERSION2 callbacks); connect it with `connect`."""
    if opts.protocol not in ("5", "3.1.1"):
        raise MqttSetupError(f"protocol {opts.protocol!r}: allowed values: \"5\", \"3.1.1\"")
    addr = opts.address
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=opts.client_id,
        clean_session=None if opts.v5 else opts.session_expiry_s is None,
        protocol=mqtt.MQTTv5 if opts.v5 else mqtt.MQTTv311,
        manual_ack=opts.manual_ack,
    )
    client.on_socket_open = set_nodelay
    client.reconnect_delay_set(opts.reconnect_min_delay_s, opts.reconnect_max_delay_s)  # type: ignore[arg-type]
    if opts.max_queued_messages:
        client.max_queued_messages_set(opts.max_queued_messages)
    if opts.will_topic:
        client.will_set(opts.will_topic, opts.will_payload, qos=opts.will_qos, retain=opts.will_retain)
    user = opts.username or addr.username
    password = opts.password or addr.password
    if opts.password_file:
        password = read_password_file(opts.password_file)
    if user:
        client.username_pw_set(user, password or None)
    if addr.tls:
        try:
            client.tls_set(
                ca_certs=opts.tls_ca_file or None,
                certfile=opts.tls_cert_file or None,
                keyfile=opts.tls_key_file or None,
                cert_reqs=ssl.CERT_REQUIRED,
            )
        except (OSError, ssl.SSLError) as exc:
            raise MqttSetupError(f"TLS files for {opts.broker}: {exc}") from None
        client.tls_insecure_set(opts.tls_insecure)
    return client


def connect(client: mqtt.Client, opts: MqttOptions, *, background: bool = False) -> None:
    """Connect with the session of `opts` (v5: clean start, session expiry,
    receive maximum). `background`: connect_async, so that paho's loop thread
    keeps trying (with the reconnect delays) while the broker is away; else
    connect now and raise OSError when the broker cannot be reached."""
    addr = opts.address
    kwargs: dict[str, object] = {}
    if opts.v5:
        props = Properties(PacketTypes.CONNECT)
        if opts.session_expiry_s is not None:
            props.SessionExpiryInterval = opts.session_expiry_s
        if opts.receive_maximum is not None:
            props.ReceiveMaximum = opts.receive_maximum
        if opts.max_packet_size is not None:
            props.MaximumPacketSize = opts.max_packet_size
        kwargs = {"clean_start": opts.session_expiry_s is None, "properties": props}
    if background:
        client.connect_async(addr.host, addr.port, opts.keepalive_s, **kwargs)  # type: ignore[arg-type]
    else:
        client.connect(addr.host, addr.port, opts.keepalive_s, **kwargs)  # type: ignore[arg-type]


def publish_properties(
    *,
    user_properties: UserProperties = (),
    correlation_data: bytes | None = None,
    response_topic: str | None = None,
    content_type: str | None = None,
    message_expiry_s: int | None = None,
) -> Properties:
    """MQTT v5 PUBLISH properties; only what is given is set."""
    props = Properties(PacketTypes.PUBLISH)
    pairs = list(user_properties)
    if pairs:
        props.UserProperty = pairs
    if correlation_data is not None:
        props.CorrelationData = correlation_data
    if response_topic:
        props.ResponseTopic = response_topic
    if content_type:
        props.ContentType = content_type
    if message_expiry_s is not None:
        props.MessageExpiryInterval = message_expiry_s
    return props


@dataclass(frozen=True)
class ReceivedProperties:
    """The MQTT v5 properties of a received message (all empty for v3.1.1)."""

    user_properties: list[tuple[str, str]]
    response_topic: str | None = None
    correlation_data: bytes | None = None
    message_expiry_s: int | None = None  # what was left of the expiry when the broker forwarded it


def received_properties(msg: mqtt.MQTTMessage) -> ReceivedProperties:
    """The v5 properties of `msg`. paho's Properties object has an attribute only
    for a property the sender set, so they are read here, once, for every client."""
    props = msg.properties
    if props is None:
        return ReceivedProperties([])
    return ReceivedProperties(
        list(getattr(props, "UserProperty", None) or []),
        getattr(props, "ResponseTopic", None) or None,
        getattr(props, "CorrelationData", None),
        getattr(props, "MessageExpiryInterval", None),
    )
