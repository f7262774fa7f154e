"""Typed settings of the cloud bridge, built once from a TOML file and the
command line flags, validated with messages that name the field and what is
allowed.

Example (every key optional; these are the defaults)::

    [mqtt]
    broker = "mqtt://localhost:1883"     # mqtts://host:8883 for TLS
    client_id = "cosyedge-bridge-1"      # fixed: the persistent session is keyed by it; one per replica
    username = ""                        # the bridge's privileged broker user
    password_file = ""                   # file holding the password (or `password`)
    topic_root = "cosyedge"
    share_group = "cosyedge-bridge"      # replicas with the same group split the requests
    session_expiry_s = 3600
    keepalive_s = 30
    response_expiry_s = 300              # MQTT v5 message expiry of the responses

    [triton]
    url = "localhost:8001"               # gRPC
    model = "cosyvoice2"
    default_version = ""                 # "": the highest version Triton has loaded
    canary_version = ""                  # e.g. "2"
    canary_share = 0.0                   # share of unpinned requests sent to canary_version
    allowed_versions = []                # versions a request may pin; empty: any loaded
    first_chunk_timeout_s = 60.0
    chunk_timeout_s = 30.0
    request_timeout_s = 600.0
    retries = 2                          # on transient errors, before the first chunk only
    retry_backoff_ms = 250

    [limits]
    max_in_flight = 8                    # concurrent Triton streams
    max_queued = 16                      # accepted, waiting for a stream
    overflow = "busy"                    # "busy": answer busy when full; "wait": the broker holds them
    max_payload_bytes = 4000000
    max_text_chars = 5000
    drain_timeout_s = 30.0

    [metrics]
    port = 9109                          # Prometheus /metrics; 0 turns it off
    address = "127.0.0.1"
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints
from urllib.parse import urlparse

from models.errors import CosyEdgeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class SettingsError(CosyEdgeError):
    """A setting with a wrong value; the message names the field."""


def setting(
    default: Any,
    doc: str,
    *,
    min: float | None = None,
    max: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    return field(default=default, metadata={"doc": doc, "min": min, "max": max, "choices": choices})


@dataclass(frozen=True)
class MqttSettings:
    broker: str = setting("mqtt://localhost:1883", "broker URL: mqtt://host:port or mqtts://host:port")
    client_id: str = setting("cosyedge-bridge-1", "fixed client id (the persistent session); one per replica")
    username: str = setting("", "broker user name")
    password: str = setting("", "broker password (prefer password_file)")
    password_file: str = setting("", "file whose first line is the broker password")
    topic_root: str = setting("cosyedge", "topic root; devices use <root>/<device_id>/cloud/...")
    share_group: str = setting("cosyedge-bridge", "shared subscription group of the replicas")
    session_expiry_s: int = setting(3600, "MQTT v5 session expiry", min=0, max=2**32 - 1)
    keepalive_s: int = setting(30, "MQTT keepalive", min=5, max=3600)
    response_expiry_s: int = setting(300, "MQTT v5 message expiry of responses", min=1, max=86400)
    tls_ca_file: str = setting("", "CA bundle for mqtts:// (empty: the system's)")
    tls_cert_file: str = setting("", "client certificate (mutual TLS)")
    tls_key_file: str = setting("", "client key (mutual TLS)")

    def __post_init__(self) -> None:
        url = urlparse(self.broker)
        if url.scheme not in ("mqtt", "mqtts", "tcp", "ssl") or not url.hostname:
            raise SettingsError(
                f"mqtt.broker must look like mqtt://host:1883 or mqtts://host:8883, got {self.broker!r}"
            )
        for name in ("client_id", "share_group"):
            value = getattr(self, name)
            if not value or any(c in value for c in "/+#"):
                raise SettingsError(f"mqtt.{name} must be non-empty without '/', '+' or '#', got {value!r}")
        if self.password and self.password_file:
            raise SettingsError("set mqtt.password or mqtt.password_file, not both")

    @property
    def tls(self) -> bool:
        return urlparse(self.broker).scheme in ("mqtts", "ssl")

    @property
    def host(self) -> str:
        return urlparse(self.broker).hostname or "localhost"

    @property
    def port(self) -> int:
        url = urlparse(self.broker)
        return url.port or (8883 if self.tls else 1883)

    def read_password(self) -> str | None:
        if self.password_file:
            try:
                return Path(self.password_file).read_text().splitlines()[0]
            except (OSError, IndexError) as exc:
                raise SettingsError(f"mqtt.password_file {self.password_file!r} cannot be read: {exc}") from None
        return self.password or None


@dataclass(frozen=True)
class TritonSettings:
    url: str = setting("localhost:8001", "Triton gRPC endpoint host:port")
    model: str = setting("cosyvoice2", "model name in the repository")
    default_version: str = setting("", "version for unpinned requests; empty: Triton's highest loaded")
    canary_version: str = setting("", "a new version that gets canary_share of the unpinned requests")
    canary_share: float = setting(0.0, "share of unpinned requests for canary_version", min=0.0, max=1.0)
    canary_seed: int = setting(-1, "seed of the canary selection (-1: random); for tests", min=-1)
    allowed_versions: tuple[str, ...] = setting((), "versions a request may pin; empty: any")
    first_chunk_timeout_s: float = setting(60.0, "wait for the first chunk", min=0.1, max=3600)
    chunk_timeout_s: float = setting(30.0, "wait between chunks", min=0.1, max=3600)
    request_timeout_s: float = setting(600.0, "whole request (gRPC stream deadline)", min=1, max=86400)
    retries: int = setting(2, "retries on transient errors before the first chunk", min=0, max=10)
    retry_backoff_ms: int = setting(250, "first retry delay, doubled each retry", min=0, max=60000)

    def __post_init__(self) -> None:
        host, _, port = self.url.rpartition(":")
        if not host or not port.isdigit():
            raise SettingsError(f"triton.url must be host:port (gRPC), got {self.url!r}")
        for name in ("default_version", "canary_version"):
            value = getattr(self, name)
            if value and not (value.isdigit() and int(value) > 0):
                raise SettingsError(f'triton.{name} must be empty or a version number like "2", got {value!r}')
        for v in self.allowed_versions:
            if not (v.isdigit() and int(v) > 0):
                raise SettingsError(f'triton.allowed_versions must hold version numbers like "2", got {v!r}')
        if self.canary_share > 0 and not self.canary_version:
            raise SettingsError("triton.canary_share > 0 needs triton.canary_version")


@dataclass(frozen=True)
class LimitSettings:
    max_in_flight: int = setting(8, "concurrent Triton streams", min=1, max=1024)
    max_queued: int = setting(16, "accepted requests waiting for a stream", min=0, max=100000)
    overflow: str = setting(
        "busy", "when full: 'busy' answers busy; 'wait' lets the broker hold them", choices=("busy", "wait")
    )
    max_payload_bytes: int = setting(4_000_000, "largest request payload", min=1024, max=256_000_000)
    max_text_chars: int = setting(5000, "longest text", min=1, max=1_000_000)
    drain_timeout_s: float = setting(30.0, "on SIGTERM, time to finish in-flight requests", min=0, max=3600)
    dedup_window: int = setting(4096, "recent request ids remembered to drop redeliveries", min=0, max=10**6)


@dataclass(frozen=True)
class MetricsSettings:
    port: int = setting(9109, "Prometheus /metrics port; 0: off", min=0, max=65535)
    address: str = setting("127.0.0.1", "address the metrics endpoint binds")


@dataclass(frozen=True)
class BridgeSettings:
    mqtt: MqttSettings = field(default_factory=MqttSettings)
    triton: TritonSettings = field(default_factory=TritonSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)


_SECTIONS: dict[str, type] = {
    "mqtt": MqttSettings,
    "triton": TritonSettings,
    "limits": LimitSettings,
    "metrics": MetricsSettings,
}


def _coerce(section: str, cls: type, name: str, value: Any) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    hint = get_type_hints(cls)[name]
    where = f"{section}.{name}"
    meta = f.metadata
    if hint is bool:
        if not isinstance(value, bool):
            raise SettingsError(f"{where} must be true or false, got {value!r}")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingsError(f"{where} must be an integer, got {value!r}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingsError(f"{where} must be a number, got {value!r}")
        value = float(value)
    elif hint is str:
        if not isinstance(value, str):
            raise SettingsError(f"{where} must be a string, got {value!r}")
    else:  # tuple[str, ...]
        if isinstance(value, str) or not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
            raise SettingsError(f"{where} must be a list of strings, got {value!r}")
        value = tuple(str(v) for v in value)
    if meta.get("choices") and value not in meta["choices"]:
        raise SettingsError(f"{where} must be one of {', '.join(meta['choices'])}, got {value!r}")
    if meta.get("min") is not None and value < meta["min"]:
        raise SettingsError(f"{where} must be >= {meta['min']}, got {value!r}")
    if meta.get("max") is not None and value > meta["max"]:
        raise SettingsError(f"{where} must be <= {meta['max']}, got {value!r}")
    return value


def build_settings(doc: dict[str, Any]) -> BridgeSettings:
    """Settings from a parsed TOML document (sections mqtt, triton, limits, metrics)."""
    unknown = sorted(set(doc) - set(_SECTIONS))
    if unknown:
        raise SettingsError(f"unknown section(s) {', '.join(unknown)}; allowed: {', '.join(_SECTIONS)}")
    parts: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        values = doc.get(section, {})
        if not isinstance(values, dict):
            raise SettingsError(f"[{section}] must be a table")
        names = [f.name for f in dataclasses.fields(cls)]
        bad = sorted(set(values) - set(names))
        if bad:
            raise SettingsError(
                f"unknown key(s) {', '.join(section + '.' + b for b in bad)}; "
                f"allowed in [{section}]: {', '.join(names)}"
            )
        kwargs = {k: _coerce(section, cls, k, v) for k, v in values.items()}
        parts[section] = cls(**kwargs)
    return BridgeSettings(**parts)


def load_settings(
    path: str | Path | None = None, *, broker: str | None = None, triton_url: str | None = None
) -> BridgeSettings:
    """The TOML file (optional) with the command line flags on top."""
    doc: dict[str, Any] = {}
    if path is not None:
        try:
            doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise SettingsError(f"cannot read the config file {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    if broker:
        doc.setdefault("mqtt", {})["broker"] = broker
    if triton_url:
        doc.setdefault("triton", {})["url"] = triton_url
    return build_settings(doc)
