"""The daemon's settings, one frozen dataclass per config-file section. The
defaults are what `cosyedge run` uses without a config file."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

from cosyedge_cloud.wire.mqtt_settings import MqttSettings
from cosyedge_cloud.wire.protocol import MAX_REQUEST_BYTES
from cosyedge_daemon.settings.audio import AudioSettings, VadSettings
from cosyedge_daemon.settings.http import HttpSettings
from cosyedge_daemon.settings.topics import NativeTopics, topic_problem
from cosyedge_daemon.settings.tts import TtsSettings
from cosyedge_daemon.settings.wyoming import SatelliteSettings, WyomingSettings
from cosyedge_models.settings_schema import setting

PRIORITY_MIN, PRIORITY_MAX = -1000, 1000


def _prefix_ok(prefix: str) -> bool:
    return not prefix or (topic_problem(prefix) is None and not prefix.endswith("/"))


def _site_ids_ok(sites: tuple[str, ...]) -> bool:
    # a siteId becomes one topic level (hermes/audioServer/<siteId>/...): no control characters either
    return all("/" not in site and topic_problem(site) is None for site in sites)


@dataclass(frozen=True)
class DeviceMqttSettings(MqttSettings):
    """The daemon's [mqtt]: the shared connection settings and the device's own."""

    protocol: str = setting("5", "MQTT protocol version", choices=("5", "3.1.1"))
    topic_prefix: str = setting(
        "", "topic prefix; empty: cosyedge/<device_id>",
        check=_prefix_ok, allowed="topic levels without + #, control characters or a trailing /",
    )
    reconnect_min_delay_s: float = setting(
        0.5, "first reconnect delay (doubles up to the maximum)", min=0.1, max=60
    )
    reconnect_max_delay_s: float = setting(30.0, "longest reconnect delay", min=1, max=3600)
    qos: int = setting(1, "QoS of subscriptions and of everything the daemon publishes", choices=(0, 1, 2))
    max_payload_bytes: int = setting(
        MAX_REQUEST_BYTES, "larger requests are rejected with payload_too_large (the cloud bridge's "
        "[limits] max_payload_bytes must exceed it by 65536)", min=1024, max=268_435_455, live=True
    )
    audio_header: str = setting(
        "auto",
        "16-byte header on audio chunks: auto = only with MQTT 3.1.1 "
        "(v5 carries the same in user properties)",
        choices=("auto", "always", "never"),
    )
    inbound_queue: int = setting(
        256, "messages parsed but not yet handled; beyond it: busy", min=1, max=100_000
    )
    response_topic_prefix: str = setting(
        "",
        "MQTT v5 ResponseTopics must lie below this prefix, which may also lie inside the namespaces the "
        "daemon refuses by default (empty: any topic except wildcards, the daemon's own input topics, "
        "its status topics and hermes/)",
        check=_prefix_ok, allowed="topic levels without + #, control characters or a trailing /",
    )
    local_broker: str = setting(
        "auto",
        "auto: start a private mosquitto when the broker is on this host and nothing listens on its port",
        choices=("auto", "off"),
    )


@dataclass(frozen=True)
class FallbackSettings:
    enabled: bool = setting(
        True, "answer with espeak-ng when the local synthesizer is missing or fails", live=True
    )
    binary: str = setting("espeak-ng", "the espeak-ng executable")
    voice: str = setting("en-us", "espeak-ng voice (espeak-ng --voices)")
    rate_wpm: int = setting(175, "speaking rate in words per minute", min=80, max=500)
    sample_rate_hz: int = setting(
        24000,
        "output rate when no bundle is loaded (else the bundle's rate)",
        choices=(16000, 22050, 24000, 44100, 48000),
        aliases=("sample_rate",),
    )


@dataclass(frozen=True)
class SchedulerSettings:
    max_queue: int = setting(
        32, "queued requests beyond this are rejected with busy", min=1, max=10_000, live=True
    )
    max_wait_ms: int = setting(
        30_000,
        "reject with busy when the estimated wait exceeds this (0: off)",
        min=0,
        max=3_600_000,
        live=True,
    )
    preempt: bool = setting(
        False,
        "a higher-priority request interrupts lower-priority ones in "
        "progress (they end with reason preempted)",
        live=True,
    )
    default_priority: int = setting(
        0, "priority of requests that give none", min=PRIORITY_MIN, max=PRIORITY_MAX, live=True
    )
    default_deadline_ms: int = setting(
        0, "deadline of requests that give none (0: none)", min=0, max=86_400_000, live=True
    )
    dedupe_window_s: int = setting(
        600,
        "a request id seen this recently is never spoken again (0: no duplicate check)",
        min=0,
        max=86_400,
        live=True,
    )
    dedupe_max_ids: int = setting(4096, "ids remembered for the duplicate check", min=16, max=1_000_000)
    synth_ahead_chunks: int = setting(
        8, "chunks synthesized ahead of playback (bounded queue)", min=1, max=256
    )
    degraded_queue_depth: int = setting(
        4,
        "from this queue depth on, buffer less ahead and tell the synthesizer to cut batching delay",
        min=1,
        max=10_000,
        live=True,
    )


@dataclass(frozen=True)
class RoutingSettings:
    default_route: str = setting(
        "auto", "route of requests that give none", choices=("auto", "local", "cloud"), live=True
    )
    fallback_on_error: bool = setting(
        True, "retry on the fallback voice when a synthesizer fails before any audio went out", live=True
    )
    max_consecutive_failures: int = setting(
        3, "after this many failures in a row a synthesizer counts as unhealthy", min=1, max=1000, live=True
    )
    unhealthy_retry_s: float = setting(
        30.0, "an unhealthy synthesizer is tried again after this long", min=1, max=86_400, live=True
    )
    # route = "auto": the rules that send a request to the cloud (when the cloud synthesizer is up)
    cloud_min_chars: int = setting(
        400, "auto: texts of at least this many characters go to the cloud (0: off)", min=0, max=1_000_000,
        live=True,
    )
    cloud_min_tokens: int = setting(
        0,
        "auto: texts of at least this many tokens (words and punctuation marks) go to the cloud (0: off)",
        min=0,
        max=1_000_000,
        live=True,
    )
    cloud_modes: tuple[str, ...] = setting(
        ("zero_shot", "cross_lingual", "instruct"),
        "auto: modes sent to the cloud (besides any the local bundle does not serve)",
        live=True,
    )
    cloud_voices: tuple[str, ...] = setting(
        (), "auto: voices sent to the cloud (besides any the local bundle lacks)", live=True
    )
    cloud_queue_depth: int = setting(
        0,
        "auto: from this many requests waiting locally on, new ones go to the cloud (0: off)",
        min=0,
        max=10_000,
        live=True,
    )
    deadline_margin_ms: int = setting(
        0,
        "auto: a request goes to the cloud when the estimated local wait plus this margin "
        "exceeds the time left to its deadline",
        min=0,
        max=600_000,
        live=True,
    )


@dataclass(frozen=True)
class CloudSettings:
    enabled: bool = setting(
        False, "offload to the cloud bridge over this daemon's MQTT connection (see Cloud offload)"
    )
    topic_root: str = setting(
        "cosyedge",
        "root of the cloud topics: <root>/<device_id>/cloud/request, .../cloud/response/<id>, .../cloud/link",
    )
    model_version: str = setting("", "pin a cloud model version, e.g. \"2\" (empty: the bridge's choice)")
    first_chunk_timeout_s: float = setting(
        10.0,
        "no first audio chunk from the cloud this long after sending (or by the request's deadline): "
        "the cloud counts as failed and the router falls back",
        min=0.1,
        max=3600,
        live=True,
    )
    chunk_timeout_s: float = setting(
        10.0, "longest wait for the next chunk, the done or the error message", min=0.1, max=3600, live=True
    )
    request_expiry_s: int = setting(
        60,
        "MQTT v5 message expiry of a request without a deadline (a stale request is not synthesized)",
        min=1,
        max=86_400,
        live=True,
    )


@dataclass(frozen=True)
class HermesSettings:
    enabled: bool = setting(True, "serve Rhasspy Hermes topics (hermes/tts/say, voiceActivity)")
    site_ids: tuple[str, ...] = setting(
        (), "siteIds this device answers for; empty: its device id",
        check=_site_ids_ok, allowed="siteIds, each non-empty without / + # or control characters",
    )
    output: str = setting(
        "play",
        "play: speak locally; publish: WAV on hermes/audioServer/<siteId>/playBytes/<id>",
        choices=("play", "publish"),
        live=True,
    )


@dataclass(frozen=True)
class HealthSettings:
    metrics_port: int = setting(9464, "Prometheus /metrics port on metrics_host (0: off)", min=0, max=65535)
    metrics_host: str = setting("127.0.0.1", "address the metrics endpoint binds to")
    health_interval_s: float = setting(
        30.0, "period of the retained health JSON (also sent on change)", min=1, max=3600, live=True
    )
    watchdog_stall_s: float = setting(
        120.0, "a worker without a heartbeat this long stops the systemd watchdog pings", min=5, max=3600
    )
    stop_timeout_s: float = setting(
        20.0,
        "SIGTERM: time to finish in-flight requests before they are cancelled (keep below TimeoutStopSec)",
        min=0,
        max=600,
        live=True,
    )
    log_traces: bool = setting(True, "log one JSON line per finished request", live=True)


def _frozen(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class Settings:
    device_id: str
    mqtt: DeviceMqttSettings = field(default_factory=DeviceMqttSettings)
    tts: TtsSettings = field(default_factory=TtsSettings)
    fallback: FallbackSettings = field(default_factory=FallbackSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    cloud: CloudSettings = field(default_factory=CloudSettings)
    hermes: HermesSettings = field(default_factory=HermesSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    wyoming: WyomingSettings = field(default_factory=WyomingSettings)
    wyoming_satellite: SatelliteSettings = field(default_factory=SatelliteSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    # Owned by the audio side: validated by AudioSettings / VadSettings
    # (audio_settings / vad_settings below, checked when the config loads).
    audio: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))
    vad: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))

    @property
    def topic_prefix(self) -> str:
        return self.mqtt.topic_prefix or f"cosyedge/{self.device_id}"

    @property
    def topics(self) -> NativeTopics:
        return NativeTopics(self.topic_prefix)

    @property
    def site_ids(self) -> tuple[str, ...]:
        return self.hermes.site_ids or (self.device_id,)

    # The audio side's dataclasses validate these tables (daemon/settings/audio.py).
    # The daemon's own `device` key (and `--audio`) names both the speaker
    # and the microphone unless output_device / input_device are given.
    @property
    def audio_device(self) -> str:
        """'none', 'default' or a device name."""
        return str(self.audio.get("device", self.audio.get("output_device", "default")))

    @cached_property  # built (and validated) once per Settings: when the config loads
    def audio_settings(self) -> AudioSettings:
        table = {k: v for k, v in self.audio.items() if k != "device"}
        if "device" in self.audio:
            table.setdefault("output_device", self.audio["device"])
            table.setdefault("input_device", self.audio["device"])
        return AudioSettings.from_mapping(table)

    @cached_property
    def vad_settings(self) -> VadSettings:
        return VadSettings.from_mapping(self.vad)

    @property
    def vad_enabled(self) -> bool:
        return self.vad_settings.enabled and self.audio_settings.capture

    @property
    def barge_in(self) -> str:
        """'stop', 'duck' or 'off'."""
        return self.vad_settings.barge_in

    @property
    def duck_gain(self) -> float:
        return self.vad_settings.duck_gain


SECTIONS: dict[str, type] = {
    "mqtt": DeviceMqttSettings,
    "tts": TtsSettings,
    "fallback": FallbackSettings,
    "scheduler": SchedulerSettings,
    "routing": RoutingSettings,
    "cloud": CloudSettings,
    "hermes": HermesSettings,
    "health": HealthSettings,
    "wyoming": WyomingSettings,
    "wyoming.satellite": SatelliteSettings,  # a sub-table: [wyoming.satellite]
    "http": HttpSettings,
}


def section_attr(name: str) -> str:
    """The Settings attribute of a SECTIONS key ("wyoming.satellite" -> wyoming_satellite)."""
    return name.replace(".", "_")
