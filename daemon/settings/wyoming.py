"""The `[wyoming]` and `[wyoming.satellite]` config tables (the one settings
schema: models/settings_schema.py)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from cosyedge_models.settings_schema import ConfigError, setting


@dataclass(frozen=True)
class WyomingSettings:
    uri: str = setting(
        "", "the Wyoming TTS server, tcp://HOST:PORT (conventionally port 10200); empty: off "
        "(--wyoming-uri sets it)"
    )
    zeroconf: str = setting(
        "auto", "advertise the Wyoming listeners as _wyoming._tcp.local. (Home Assistant discovers them); "
        "auto: when they listen on a non-loopback address",
        choices=("auto", "on", "off"),
    )
    zeroconf_name: str = setting("", "the advertised service name; empty: cosyedge-<device_id>")
    max_connections: int = setting(
        32, "open Wyoming connections beyond this are refused with an error event", min=1, max=10_000
    )
    idle_timeout_s: float = setting(
        120.0, "a TTS connection that sends nothing this long is closed", min=1, max=86_400
    )
    max_event_bytes: int = setting(
        1_048_576, "largest event (header line, data and payload); larger: error event, connection closed",
        min=1024, max=268_435_455,
    )
    read_timeout_s: float = setting(
        10.0, "time allowed for the rest of an event once its header arrived (a lying payload length)",
        min=0.1, max=3600,
    )
    priority: int = setting(0, "scheduler priority of Wyoming requests", min=-1000, max=1000)
    max_buffered_audio_s: float = setting(
        60.0, "audio produced but not yet read by the client beyond which the request is cancelled",
        min=1, max=3600,
    )


@dataclass(frozen=True)
class SatelliteSettings:
    uri: str = setting(
        "", "the board as a Wyoming satellite, tcp://HOST:PORT (conventionally port 10700); empty: off"
    )
    name: str = setting("", "the satellite's name in Home Assistant; empty: the device id")
    area: str = setting("", "the area Home Assistant suggests for it (empty: none)")
    start_stage: str = setting(
        "asr", "the pipeline stage a detected utterance starts: asr (speech to text), or wake "
        "(Home Assistant's wake-word service checks the utterance first)",
        choices=("asr", "wake"),
    )
    max_utterance_s: float = setting(
        15.0, "an utterance streamed longer than this is ended (audio-stop)", min=1, max=300
    )


def parse_tcp_uri(uri: str, where: str) -> tuple[str, int]:
    """(host, port) of tcp://HOST:PORT (IPv6 in brackets); ConfigError naming `where` otherwise."""
    try:
        parsed = urlparse(uri.strip())
        host, port = parsed.hostname, parsed.port
    except ValueError:
        host = port = None
    if not uri.startswith("tcp://") or not host or port is None:
        raise ConfigError(f"{where} = {uri!r}: expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:10200")
    return host, port
