"""The `[http]` config table: the OpenAI-style speech API of `cosyedge run`
(daemon/http), and the one parser of its listen address."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from cosyedge_models.settings_schema import ConfigError, setting

DOCUMENTED_LISTEN = "127.0.0.1:8880"


def parse_listen(value: str, where: str) -> tuple[str, int]:
    """(host, port) of HOST:PORT ([IPv6]:PORT); ConfigError naming `where` otherwise.
    Port 0 picks a free port (tests)."""
    text = value.strip()
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            host = ""
    elif ":" in host:
        host = ""  # an IPv6 address needs brackets
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{where} = {value!r}: expected HOST:PORT, e.g. {DOCUMENTED_LISTEN} "
                          "(0.0.0.0:8880 for every interface, [::1]:8880 for IPv6)")
    return host, int(port_text)


def _listen_ok(value: str) -> bool:
    if not value:
        return True
    try:
        parse_listen(value, "[http] listen")
    except ConfigError:
        return False
    return True


@dataclass(frozen=True)
class HttpSettings:
    listen: str = setting(
        "", f"the OpenAI-style speech API, HOST:PORT (conventionally {DOCUMENTED_LISTEN}); empty: off "
        "(--http-listen sets it)",
        check=_listen_ok, allowed="HOST:PORT, [IPv6]:PORT or empty",
    )
    api_key: str = setting(
        "", "the bearer token clients must send (Authorization: Bearer KEY); empty: none asked "
        "(prefer api_key_file)"
    )
    api_key_file: str = setting("", "file whose first line is the bearer token (e.g. a systemd credential)")
    max_body_bytes: int = setting(
        262_144, "larger request bodies are refused with payload_too_large", min=1024, max=16_777_216
    )
    max_connections: int = setting(
        64, "requests in progress beyond this are refused with busy (HTTP 429)", min=1, max=10_000
    )
    priority: int = setting(0, "scheduler priority of HTTP requests", min=-1000, max=1000)
    max_buffered_audio_s: float = setting(
        60.0, "audio produced but not yet read by the client beyond which the request is cancelled",
        min=1, max=3600,
    )
    write_timeout_s: float = setting(
        30.0, "a client that takes none of its audio this long is disconnected and its request cancelled",
        min=0.1, max=3600,
    )
