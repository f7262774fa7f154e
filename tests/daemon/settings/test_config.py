from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
from cosyedge_daemon.settings.audio import AudioSettings, VadSettings
from cosyedge_daemon.settings.loader import (
    ConfigError,
    apply_flags,
    example_toml,
    load_settings,
    parse_broker_url,
    reference_markdown,
    settings_from_mapping,
)
from cosyedge_daemon.settings.schema import SECTIONS

ROOT = Path(__file__).resolve().parents[3]


def _flags(**kw: object) -> argparse.Namespace:
    base = {"config": None, "broker": None, "device_id": None, "bundle": None, "audio": None}
    base.update(kw)
    return argparse.Namespace(**base)


def test_defaults_without_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "jetson-orin.local")
    s = load_settings(None, _flags())
    assert s.device_id == "jetson-orin"
    assert s.topic_prefix == "cosyedge/jetson-orin"
    assert s.mqtt.broker == "mqtt://localhost:1883"
    assert s.mqtt.protocol == "5"
    assert s.site_ids == ("jetson-orin",)
    assert s.tts.bundle == ""


def test_file_and_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'device_id = "dev1"\n[mqtt]\nbroker = "mqtt://10.0.0.2"\nprotocol = "3.1.1"\n'
        '[scheduler]\nmax_queue = 3\npreempt = true\n[hermes]\nsite_ids = ["kitchen"]\n'
        '[audio]\ndevice = "hw:1"\n'
    )
    s = load_settings(cfg, _flags())
    assert (s.device_id, s.mqtt.broker, s.mqtt.protocol) == ("dev1", "mqtt://10.0.0.2", "3.1.1")
    assert s.scheduler.max_queue == 3 and s.scheduler.preempt is True
    assert s.site_ids == ("kitchen",)
    assert s.audio_device == "hw:1"
    s2 = load_settings(cfg, _flags(broker="mqtts://b:8884", device_id="dev2", bundle="/opt/b", audio="none"))
    assert (s2.mqtt.broker, s2.device_id, s2.tts.bundle, s2.audio_device) == (
        "mqtts://b:8884",
        "dev2",
        "/opt/b",
        "none",
    )
    assert s2.scheduler.max_queue == 3  # the file still applies where no flag overrides it


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"mqtt": {"protocol": "4"}}, '[mqtt] protocol = "4": allowed values: "5", "3.1.1"'),
        ({"scheduler": {"max_queue": 0}}, "[scheduler] max_queue = 0: must be between 1 and 10000"),
        ({"scheduler": {"max_queue": "10"}}, '[scheduler] max_queue: expected an integer, got "10"'),
        ({"scheduler": {"preempt": 1}}, "[scheduler] preempt: expected true or false, got 1"),
        ({"mqtt": {"brokr": "x"}}, "[mqtt] unknown key brokr; known keys: broker, username"),
        ({"mqt": {}}, "unknown top-level key(s) mqt"),
        ({"hermes": {"site_ids": "kitchen"}}, "[hermes] site_ids: expected a list of strings"),
        ({"hermes": {"site_ids": ["a/b"]}}, '[hermes] site_ids = ["a/b"]: allowed values: siteIds, each non-empty'),
        ({"mqtt": {"topic_prefix": "a/#"}}, '[mqtt] topic_prefix = "a/#": allowed values: topic levels without'),
        ({"device_id": "my device"}, "device_id = 'my device': use 1-64 characters"),
        ({"mqtt": {"broker": "http://x"}}, '[mqtt] broker = "http://x": allowed values: mqtt://host[:port]'),
        ({"tts": {"backend": "cuda"}}, '[tts] backend = "cuda": allowed values: "ort", "ort-cuda", "ort-trt", "trt"'),
        ({"mqtt": {"reconnect_min_delay_s": 50, "reconnect_max_delay_s": 10}}, "must not exceed"),
        ({"tts": {"synthesis_workers": "many"}},
         '[tts] synthesis_workers = "many": allowed values: "auto" or an integer 1 .. 64'),
        ({"tts": {"synthesis_workers": 0}}, '[tts] synthesis_workers = 0: allowed values: "auto" or an integer'),
        ({"tts": {"synthesis_workers": True}}, "[tts] synthesis_workers = true: allowed values"),
        ({"tts": {"graph_threads": "two"}}, '[tts] graph_threads = "two": allowed values: "one", "per-stage"'),
        ({"tts": {"llm_parallel_prefills": 0}}, "[tts] llm_parallel_prefills = 0: must be between 1 and 16"),
    ],
)
def test_validation_names_field_and_allowed(data: dict, expected: str) -> None:
    data.setdefault("device_id", "d")
    with pytest.raises(ConfigError) as err:
        settings_from_mapping(data)
    assert expected in str(err.value)


@pytest.mark.parametrize(("tts", "workers"), [
    ({}, 1),  # no LLM batching: nothing to batch
    ({"llm_max_batch_size": 2}, 2),
    ({"llm_max_batch_size": 16}, 4),
    ({"llm_max_batch_size": 16, "graph_flow_batch": True}, 16),  # the lanes batch the flow; their seats bound it
    ({"llm_max_batch_size": 256, "graph_flow_batch": True}, 64),
    ({"llm_max_batch_size": 16, "engine": "espeak-ng"}, 1),
    ({"synthesis_workers": 3}, 3),
    ({"synthesis_workers": "auto", "llm_max_batch_size": 3}, 3),
])
def test_synthesis_workers_auto_follows_llm_batching(tts: dict, workers: int) -> None:
    assert settings_from_mapping({"device_id": "d", "tts": tts}).tts.synthesis_worker_count == workers


def test_int_accepted_for_float_and_frozen() -> None:
    s = settings_from_mapping({"device_id": "d", "health": {"stop_timeout_s": 3}})
    assert s.health.stop_timeout_s == 3.0 and isinstance(s.health.stop_timeout_s, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.health.stop_timeout_s = 1.0  # type: ignore[misc]


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[mqtt\nbroker=")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_settings(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_flag_values_are_validated() -> None:
    s = settings_from_mapping({"device_id": "d"})
    with pytest.raises(ConfigError, match="broker"):
        apply_flags(s, _flags(broker="ftp://x"))
    with pytest.raises(ConfigError, match="device_id"):
        apply_flags(s, _flags(device_id="a/b"))


def test_broker_urls() -> None:
    a = parse_broker_url("mqtt://u:p@host:1999")
    assert (a.host, a.port, a.tls, a.username, a.password) == ("host", 1999, False, "u", "p")
    assert parse_broker_url("mqtts://h").port == 8883 and parse_broker_url("mqtts://h").tls
    assert parse_broker_url("localhost").port == 1883
    assert parse_broker_url("mqtt://[::1]:1884").host == "::1"


def test_example_config_is_current_and_complete() -> None:
    """systemd/cosyedge.toml is the generated example (`python -m cosyedge_daemon.settings.loader`),
    lists every key, and loads to the defaults."""
    text = (ROOT / "systemd" / "cosyedge.toml").read_text()
    assert text == example_toml(), "regenerate: python -m cosyedge_daemon.settings.loader > systemd/cosyedge.toml"
    for name, cls in SECTIONS.items():
        assert f"[{name}]" in text
        for f in dataclasses.fields(cls):
            assert f"\n{f.name} = " in text, f"[{name}] {f.name} missing from the example"
    s = load_settings(ROOT / "systemd" / "cosyedge.toml")
    assert s.scheduler == SECTIONS["scheduler"]()
    assert s.mqtt == SECTIONS["mqtt"]()


def test_reference_docs_are_generated_and_current() -> None:
    """docs/configuration.md is what the schema renders and names every key."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert text == reference_markdown(), \
        "regenerate: python -m cosyedge_daemon.settings.loader --markdown > docs/configuration.md"
    for name, cls in {**SECTIONS, "audio": AudioSettings, "vad": VadSettings}.items():
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"[{name}] {f.name} missing from docs/configuration.md"
    assert "| `bundle` | `\"\"` |" in text and "SIGHUP reloads the engine" in text


def test_live_and_reload_keys_come_from_the_schema() -> None:
    from cosyedge_models.settings_schema import live_fields, reload_fields

    assert {"bundle", "backend", "engine", "llm_max_batch_size"} <= set(reload_fields(SECTIONS["tts"]))
    assert "max_text_chars" in live_fields(SECTIONS["tts"]) and "bundle" not in live_fields(SECTIONS["tts"])
    assert "dedupe_window_s" in live_fields(SECTIONS["scheduler"])


def test_old_key_names_are_still_read() -> None:
    assert settings_from_mapping({"fallback": {"sample_rate": 16000}}).fallback.sample_rate_hz == 16000
    with pytest.raises(ConfigError, match="sample_rate is the old name of sample_rate_hz"):
        settings_from_mapping({"fallback": {"sample_rate": 16000, "sample_rate_hz": 16000}})




@pytest.mark.parametrize(("value", "expected"), [
    ("127.0.0.1:8880", ("127.0.0.1", 8880)), ("0.0.0.0:0", ("0.0.0.0", 0)), ("[::1]:8880", ("::1", 8880)),
    ("board.local:80", ("board.local", 80)),
])
def test_http_listen_addresses(value: str, expected: tuple[str, int]) -> None:
    from cosyedge_daemon.settings.http import parse_listen

    assert parse_listen(value, "[http] listen") == expected
    assert settings_from_mapping({"device_id": "d", "http": {"listen": value}}).http.listen == value
    assert apply_flags(settings_from_mapping({"device_id": "d"}), _flags(http_listen=value)).http.listen == value


@pytest.mark.parametrize("value", ["8880", "127.0.0.1", "::1:8880", "host:99999", "host:-1", ":8880", "[nope]:80"])
def test_http_listen_refused_with_the_form(value: str) -> None:
    with pytest.raises(ConfigError, match=r"\[http\] listen.*HOST:PORT"):
        settings_from_mapping({"device_id": "d", "http": {"listen": value}})
    with pytest.raises(ConfigError, match="--http-listen"):
        apply_flags(settings_from_mapping({"device_id": "d"}), _flags(http_listen=value))
    assert settings_from_mapping({"device_id": "d"}).http.listen == ""  # off by default
