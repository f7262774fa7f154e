"""The one MQTT settings type: how a client of either side (the daemon on
the device, the bridge in the cloud) reaches its broker. Each side's
`[mqtt]` section extends it with its own keys (the daemon's
`DeviceMqttSettings`, the bridge's `BridgeMqttSettings`) and turns it into
the one client factory's `MqttOptions` with `options`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cosyedge_cloud.wire.mqtt import MqttOptions, MqttSetupError, parse_broker_url
from cosyedge_models.settings_schema import setting


def broker_ok(url: str) -> bool:
    """Whether `url` is a broker URL the client factory accepts (the settings' check)."""
    try:
        parse_broker_url(url)
    except MqttSetupError:
        return False
    return True


@dataclass(frozen=True)
class MqttSettings:
    broker: str = setting(
        "mqtt://localhost:1883", "broker URL: mqtt://host[:port] (1883) or mqtts://host[:port] (TLS, 8883)",
        check=broker_ok, allowed="mqtt://host[:port] or mqtts://host[:port]",
    )
    username: str = setting("", "user name (empty: anonymous)")
    password: str = setting("", "password (prefer password_file)")
    password_file: str = setting("", "file whose first line is the password (e.g. a systemd credential)")
    tls_ca_file: str = setting("", "CA certificate file for mqtts:// (empty: the system CAs)")
    tls_cert_file: str = setting("", "client certificate file (mutual TLS)")
    tls_key_file: str = setting("", "client key file (mutual TLS)")
    tls_insecure: bool = setting(False, "skip the server host name check (testing only)")
    keepalive_s: int = setting(30, "MQTT keep-alive interval", min=5, max=3600)
    session_expiry_s: int = setting(
        3600,
        "how long the broker keeps the session (and queued QoS 1 messages) while the client is away; MQTT v5",
        min=0,
        max=4294967295,
    )

    def options(self, client_id: str, **more: Any) -> MqttOptions:
        """The client factory's options: these settings, the client id and what the side adds."""
        return MqttOptions(
            broker=self.broker, client_id=client_id, username=self.username, password=self.password,
            password_file=self.password_file, tls_ca_file=self.tls_ca_file, tls_cert_file=self.tls_cert_file,
            tls_key_file=self.tls_key_file, tls_insecure=self.tls_insecure, keepalive_s=self.keepalive_s,
            session_expiry_s=self.session_expiry_s, **more,
        )
