"""Loads the daemon's settings: TOML file (optional) → frozen dataclasses,
then the command-line flags of DESIGN.md on top. Every error names the
field and what is allowed."""

from __future__ import annotations

import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from cosyedge_cloud.wire.mqtt import BrokerAddress, MqttSetupError
from cosyedge_cloud.wire.mqtt import parse_broker_url as _parse_broker_url
from cosyedge_daemon.settings.audio import AudioSettings, VadSettings
from cosyedge_daemon.settings.http import parse_listen
from cosyedge_daemon.settings.schema import SECTIONS, Settings, section_attr
from cosyedge_daemon.settings.wyoming import parse_tcp_uri
from cosyedge_models.settings_schema import (
    ConfigError,
    build_section,
    example_lines,
    read_toml,
    reference_table,
    replace_checked,
)

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # fullmatch: no trailing newline
_RAW_SECTIONS = ("audio", "vad")  # validated by the audio side's settings


def parse_broker_url(url: str) -> BrokerAddress:
    """mqtt://[user[:pass]@]host[:port] or mqtts://…; a bare host[:port] means mqtt://
    (the MQTT client factory's parser, with the config's error)."""
    try:
        return _parse_broker_url(url)
    except MqttSetupError as exc:
        raise ConfigError(f"[mqtt] {exc}") from None


def validate_device_id(device_id: str) -> str:
    if not _ID_RE.fullmatch(device_id):
        raise ConfigError(
            f"device_id = {device_id!r}: use 1-64 characters of A-Z a-z 0-9 . _ - (it becomes part of "
            "MQTT topics and the client id), starting with a letter or digit"
        )
    return device_id


def default_device_id() -> str:
    """The host name, made topic-safe."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname().split(".")[0]).strip("-._")
    return name[:64] or "cosyedge"


def settings_from_mapping(data: Mapping[str, Any]) -> Settings:
    known = {"device_id", *(n.split(".")[0] for n in SECTIONS), *_RAW_SECTIONS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    device_id = data.get("device_id", "")
    if not isinstance(device_id, str):
        raise ConfigError(f"device_id: expected a string, got {device_id!r}")
    sections: dict[str, Any] = {
        section_attr(name): build_section(cls, _table(data, name), name) for name, cls in SECTIONS.items()
    }
    raw: dict[str, Any] = {}
    for name in _RAW_SECTIONS:
        table = data.get(name, {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"[{name}] must be a table")
        raw[name] = MappingProxyType(dict(table))
    settings = Settings(device_id=validate_device_id(device_id or default_device_id()), **sections, **raw)
    settings.audio_settings, settings.vad_settings  # noqa: B018 -- validate the audio side's tables now
    if settings.mqtt.reconnect_min_delay_s > settings.mqtt.reconnect_max_delay_s:
        raise ConfigError("[mqtt] reconnect_min_delay_s must not exceed reconnect_max_delay_s")
    for where, uri in (("[wyoming] uri", settings.wyoming.uri), ("[wyoming.satellite] uri",
                                                                 settings.wyoming_satellite.uri)):
        if uri:
            parse_tcp_uri(uri, where)
    return settings


def _table(data: Mapping[str, Any], name: str) -> Any:
    """The TOML table of a section; "a.b" is the sub-table b of [a], and [a]'s
    own keys exclude its sub-tables that are sections."""
    table: Any = data
    for part in name.split("."):
        table = table.get(part, {}) if isinstance(table, Mapping) else table
    if isinstance(table, Mapping):
        subs = {n.split(".", 1)[1] for n in SECTIONS if n.startswith(name + ".")}
        table = {k: v for k, v in table.items() if k not in subs}
    return table


def apply_flags(settings: Settings, args: Any) -> Settings:
    """The `cosyedge run` flags override the file."""
    if getattr(args, "device_id", None):
        settings = replace(settings, device_id=validate_device_id(args.device_id))
    if getattr(args, "broker", None):
        settings = replace(settings, mqtt=replace_checked(settings.mqtt, "mqtt", broker=args.broker))
    if getattr(args, "bundle", None):
        settings = replace(settings, tts=replace_checked(settings.tts, "tts", bundle=str(args.bundle)))
    if getattr(args, "wyoming_uri", None):
        parse_tcp_uri(args.wyoming_uri, "--wyoming-uri")
        settings = replace(settings, wyoming=replace(settings.wyoming, uri=args.wyoming_uri))
    if getattr(args, "http_listen", None):
        parse_listen(args.http_listen, "--http-listen")
        settings = replace(settings, http=replace(settings.http, listen=args.http_listen))
    if getattr(args, "audio", None):
        settings = replace(settings, audio=MappingProxyType({**settings.audio, "device": args.audio}))
    return settings


def load_settings(path: str | Path | None, args: Any = None) -> Settings:
    data = read_toml(Path(path)) if path else {}
    settings = settings_from_mapping(data)
    return apply_flags(settings, args) if args is not None else settings


def example_toml() -> str:
    """The example config with every key at its default (systemd/cosyedge.toml)."""
    lines = [
        "# cosyedge daemon configuration. Every key is optional; the values below are the",
        "# defaults. `cosyedge run --config FILE` reads it; --broker, --device-id, --bundle,",
        "# --wyoming-uri, --http-listen and --audio override it. SIGHUP re-reads it (keys marked",
        "# 'reloaded by SIGHUP' apply live).",
        "",
        "# device id: MQTT topics are cosyedge/<device_id>/...; empty: the host name",
        'device_id = ""',
    ]
    for name, cls in SECTIONS.items():
        lines += ["", *example_lines(name, cls)]
    audio = example_lines("audio", AudioSettings, commented=("output_device", "input_device"))
    lines += [
        "",
        audio[0],
        '# speaker and microphone (what --audio sets): "none", "default", a device name or index',
        '# (cosyedge doctor lists them), or "wav:PATH"; output_device / input_device override it',
        'device = "default"',
        *audio[1:],
        "",
        *example_lines("vad", VadSettings),
        "",
    ]
    return "\n".join(lines)


def reference_markdown() -> str:
    """docs/configuration.md: the reference of every daemon setting."""
    lines = [
        "# Daemon configuration reference",
        "",
        "Generated from the settings schema",
        "(`python -m cosyedge_daemon.settings.loader --markdown > docs/configuration.md`);",
        "a test checks it is current. A TOML file (`cosyedge run --config FILE`); every key is optional.",
        "`systemd/cosyedge.toml` is the example with every key at its default",
        "(`python -m cosyedge_daemon.settings.loader`).",
        "Unknown keys and invalid values stop the start with a message that names the key and the allowed",
        "values. SIGHUP re-reads the file: keys marked *reloaded by SIGHUP* apply at once, keys marked",
        "*SIGHUP reloads the engine* reload the local engine, every other change is logged as needing a",
        "restart.",
        "",
        "Top level: `device_id` (default: the host name; 1-64 characters of `A-Z a-z 0-9 . _ -`).",
        "",
    ]
    for name, cls in SECTIONS.items():
        lines += reference_table(name, cls)
    lines += reference_table("audio", AudioSettings)
    lines += [
        "`[audio] device` (what `--audio` sets) names the speaker and the microphone together;",
        "`output_device` / `input_device` override it.",
        "",
    ]
    lines += reference_table("vad", VadSettings)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """python -m cosyedge_daemon.settings.loader [--markdown]: print the example config (or the reference)."""
    args = sys.argv[1:] if argv is None else argv
    print(reference_markdown() if "--markdown" in args else example_toml(), end="")


if __name__ == "__main__":
    main()
