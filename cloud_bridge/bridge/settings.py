"""Typed settings of the cloud bridge, in the one settings schema
(models/settings_schema.py): built once from a TOML file and the command line
flags, validated with messages that name the field and what is allowed.
docs/bridge-configuration.md is the reference, generated from this file
(`python -m cosyedge_cloud.bridge.settings > docs/bridge-configuration.md`; a test
checks it is current)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosyedge_cloud.wire.mqtt import BrokerAddress, parse_broker_url
from cosyedge_cloud.wire.mqtt_settings import MqttSettings
from cosyedge_cloud.wire.protocol import CLOUD_REQUEST_HEADROOM_BYTES, MAX_REQUEST_BYTES
from cosyedge_models.settings_schema import (
    ConfigError,
    build_section,
    check_fields,
    read_toml,
    reference_table,
    setting,
)
from cosyedge_models.synthesis.api import MAX_TEXT_CHARS

SettingsError = ConfigError  # a setting with a wrong value; the message names the field


def _topic_word_ok(value: str) -> bool:
    return bool(value) and not any(c in value for c in "/+#")


def _host_port_ok(url: str) -> bool:
    host, _, port = url.rpartition(":")
    return bool(host) and port.isdigit()


def _version_ok(value: str) -> bool:
    return value.isdigit() and int(value) > 0


def _versions_ok(values: tuple[str, ...]) -> bool:
    return all(_version_ok(v) for v in values)


_TOPIC_WORD = "a non-empty string without '/', '+' or '#'"


@dataclass(frozen=True)
class BridgeMqttSettings(MqttSettings):
    """The bridge's [mqtt]: the shared connection settings and the bridge's own."""

    client_id: str = setting("cosyedge-bridge-1", "fixed client id (the persistent session); one per replica",
                             check=_topic_word_ok, allowed=_TOPIC_WORD)
    topic_root: str = setting("cosyedge", "topic root; devices use <root>/<device_id>/cloud/...")
    share_group: str = setting("cosyedge-bridge", "shared subscription group: replicas with the same group "
                               "split the requests", check=_topic_word_ok, allowed=_TOPIC_WORD)
    response_expiry_s: int = setting(300, "MQTT v5 message expiry of responses", min=1, max=86400)

    def __post_init__(self) -> None:
        check_fields(self, "mqtt")
        if self.password and self.password_file:
            raise SettingsError("[mqtt] password and password_file: set one, not both")

    @property
    def address(self) -> BrokerAddress:
        return parse_broker_url(self.broker)


@dataclass(frozen=True)
class TritonSettings:
    url: str = setting("localhost:8001", "Triton gRPC endpoint host:port", check=_host_port_ok,
                       allowed="host:port (gRPC)")
    model: str = setting("cosyvoice2", "model name in the repository")
    default_version: str = setting("", "version for unpinned requests; empty: Triton's highest loaded",
                                   check=lambda v: not v or _version_ok(v),
                                   allowed='empty or a version number like "2"')
    canary_version: str = setting("", "a new version that gets canary_share of the unpinned requests",
                                  check=lambda v: not v or _version_ok(v),
                                  allowed='empty or a version number like "2"')
    canary_share: float = setting(0.0, "share of unpinned requests for canary_version", min=0.0, max=1.0)
    canary_seed: int = setting(-1, "seed of the canary selection (-1: random); for tests", min=-1)
    allowed_versions: tuple[str, ...] = setting((), "versions a request may pin; empty: any loaded",
                                                check=_versions_ok, allowed='version numbers like ["1", "2"]')
    first_chunk_timeout_s: float = setting(60.0, "wait for the first chunk", min=0.1, max=3600)
    chunk_timeout_s: float = setting(30.0, "wait between chunks", min=0.1, max=3600)
    request_timeout_s: float = setting(600.0, "whole request (gRPC stream deadline)", min=1, max=86400)
    retries: int = setting(2, "retries on transient errors, before the first chunk only", min=0, max=10)
    retry_backoff_ms: int = setting(250, "first retry delay, doubled each retry", min=0, max=60000)

    def __post_init__(self) -> None:
        check_fields(self, "triton")
        if self.canary_share > 0 and not self.canary_version:
            raise SettingsError("[triton] canary_share > 0 needs canary_version")


@dataclass(frozen=True)
class LimitSettings:
    max_in_flight: int = setting(8, "concurrent Triton streams", min=1, max=1024)
    max_queued: int = setting(16, "accepted requests waiting for a stream", min=0, max=100000)
    overflow: str = setting(
        "busy", "when full: busy answers busy; wait lets the broker hold them", choices=("busy", "wait")
    )
    max_payload_bytes: int = setting(
        MAX_REQUEST_BYTES + CLOUD_REQUEST_HEADROOM_BYTES,
        "largest request payload (at least the devices' [mqtt] max_payload_bytes + 65536)", min=1024, max=256_000_000,
    )
    max_text_chars: int = setting(
        MAX_TEXT_CHARS, "longest text (at least the devices' [tts] max_text_chars)", min=1, max=1_000_000
    )
    drain_timeout_s: float = setting(30.0, "on SIGTERM, time to finish in-flight requests", min=0, max=3600)
    dedupe_max_ids: int = setting(4096, "recent request ids remembered to drop redeliveries (0: off)",
                                  min=0, max=10**6, aliases=("dedup_window",))

    def __post_init__(self) -> None:
        check_fields(self, "limits")


@dataclass(frozen=True)
class MetricsSettings:
    port: int = setting(9109, "Prometheus /metrics port; 0: off", min=0, max=65535)
    address: str = setting("127.0.0.1", "address the metrics endpoint binds")

    def __post_init__(self) -> None:
        check_fields(self, "metrics")


@dataclass(frozen=True)
class BridgeSettings:
    mqtt: BridgeMqttSettings = field(default_factory=BridgeMqttSettings)
    triton: TritonSettings = field(default_factory=TritonSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)


_SECTIONS: dict[str, type] = {
    "mqtt": BridgeMqttSettings,
    "triton": TritonSettings,
    "limits": LimitSettings,
    "metrics": MetricsSettings,
}


def build_settings(doc: dict[str, Any]) -> BridgeSettings:
    """Settings from a parsed TOML document (sections mqtt, triton, limits, metrics)."""
    unknown = sorted(set(doc) - set(_SECTIONS))
    if unknown:
        raise SettingsError(f"unknown section(s) {', '.join(unknown)}; allowed: {', '.join(_SECTIONS)}")
    parts: dict[str, Any] = {name: build_section(cls, doc.get(name, {}), name) for name, cls in _SECTIONS.items()}
    return BridgeSettings(**parts)


def load_settings(
    path: str | Path | None = None, *, broker: str | None = None, triton_url: str | None = None
) -> BridgeSettings:
    """The TOML file (optional) with the command line flags on top."""
    doc: dict[str, Any] = {}
    if path is not None:
        doc = read_toml(path)
    if broker:
        doc.setdefault("mqtt", {})["broker"] = broker
    if triton_url:
        doc.setdefault("triton", {})["url"] = triton_url
    return build_settings(doc)


def reference_markdown() -> str:
    """docs/bridge-configuration.md: the reference of every bridge setting."""
    lines = [
        "# Cloud bridge configuration reference",
        "",
        "Generated from `cloud_bridge/bridge/settings.py` (`python -m cosyedge_cloud.bridge.settings`);",
        "a test checks it is current. A TOML file (`cosyedge bridge --config FILE`); every key is",
        "optional. Unknown keys and invalid values stop the start with a message that names the key",
        "and the allowed values. `systemd/cloud/bridge-1.toml` is the example of one replica.",
        "",
    ]
    for name, cls in _SECTIONS.items():
        lines += reference_table(name, cls)
    return "\n".join(lines)


def main() -> None:
    """python -m cosyedge_cloud.bridge.settings: print the configuration reference."""
    print(reference_markdown(), end="")


if __name__ == "__main__":
    main()
