"""The Wyoming front end's wiring: config tables and flags, zeroconf
advertisement on loopback (python-zeroconf's own browser) and its on/off
rule, `cosyedge say --wyoming`, `cosyedge doctor`, the health document, and
one end-to-end request on the real CosyVoice tiny bundle."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pytest
from cosyedge_daemon.cli.doctor import check_wyoming
from cosyedge_daemon.cli.say import say_command
from cosyedge_daemon.settings.loader import apply_flags, settings_from_mapping
from cosyedge_daemon.wyoming.client import synthesize
from cosyedge_daemon.wyoming.zeroconf import SERVICE_TYPE, Advert, advertised_addresses, service_info, should_advertise
from cosyedge_models.settings_schema import ConfigError
from cosyedge_models.synthesis.synthesizer import load_synthesizer
from wyoming.tts import Synthesize

from tests.daemon.conftest import DaemonFactory
from tests.support.fake_synthesizer import FakeSynthesizer
from tests.support.wyoming_client import exchange, run, tts_port


def test_config_tables_and_flag() -> None:
    s = settings_from_mapping({"device_id": "d", "wyoming": {"uri": "tcp://0.0.0.0:10200", "satellite": {
        "uri": "tcp://0.0.0.0:10700", "start_stage": "wake"}}})
    assert s.wyoming.uri == "tcp://0.0.0.0:10200"
    assert (s.wyoming_satellite.uri, s.wyoming_satellite.start_stage) == ("tcp://0.0.0.0:10700", "wake")
    with pytest.raises(ConfigError, match=r"\[wyoming\] uri = 'http://x': expected tcp://HOST:PORT"):
        settings_from_mapping({"device_id": "d", "wyoming": {"uri": "http://x"}})
    with pytest.raises(ConfigError, match=r"\[wyoming.satellite\] start_stage = \"intent\": allowed values"):
        settings_from_mapping({"device_id": "d", "wyoming": {"satellite": {"start_stage": "intent"}}})
    with pytest.raises(ConfigError, match=r"\[wyoming.satellite\] unknown key"):
        settings_from_mapping({"device_id": "d", "wyoming": {"satellite": {"urn": "x"}}})
    flagged = apply_flags(s, argparse.Namespace(wyoming_uri="tcp://127.0.0.1:10300"))
    assert flagged.wyoming.uri == "tcp://127.0.0.1:10300"
    with pytest.raises(ConfigError, match="--wyoming-uri"):
        apply_flags(s, argparse.Namespace(wyoming_uri="tcp://nohost"))


def test_zeroconf_rule_and_service_info() -> None:
    assert should_advertise("auto", "0.0.0.0") and should_advertise("auto", "192.168.1.5")
    assert not should_advertise("auto", "127.0.0.1") and not should_advertise("auto", "localhost")
    assert should_advertise("on", "127.0.0.1") and not should_advertise("off", "0.0.0.0")
    assert advertised_addresses("192.168.1.5") == ["192.168.1.5"]
    assert "127.0.0.1" not in advertised_addresses("0.0.0.0") or advertised_addresses("0.0.0.0") == ["127.0.0.1"]
    info = service_info(Advert("cosyedge-k", 10200, ("192.168.1.5",)))
    assert (info.type, info.name, info.port) == (SERVICE_TYPE, f"cosyedge-k.{SERVICE_TYPE}", 10200)
    assert info.parsed_addresses() == ["192.168.1.5"]


def test_zeroconf_advertisement_seen_by_a_browser(daemons: DaemonFactory) -> None:
    from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf

    svc = daemons.start(local=FakeSynthesizer(), fallback=None,
                        wyoming={"uri": "tcp://127.0.0.1:0", "zeroconf": "on", "zeroconf_name": "cosyedge-zc"})
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    found: list[str] = []

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Added:
            found.append(name)

    try:
        browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and f"cosyedge-zc.{SERVICE_TYPE}" not in found:
            time.sleep(0.05)
        assert f"cosyedge-zc.{SERVICE_TYPE}" in found
        info = zc.get_service_info(SERVICE_TYPE, f"cosyedge-zc.{SERVICE_TYPE}", timeout=3000)
        assert info is not None and info.port == tts_port(svc) and info.parsed_addresses() == ["127.0.0.1"]
        browser.cancel()
    finally:
        zc.close()
    assert svc.health_doc()["wyoming"]["zeroconf"] == ["cosyedge-zc"]


def test_say_client_and_doctor(daemons: DaemonFactory, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    svc = daemons.start(local=FakeSynthesizer(chunks=3), fallback=None,
                        wyoming={"uri": "tcp://127.0.0.1:0", "zeroconf": "off"})
    uri = f"tcp://127.0.0.1:{tts_port(svc)}"
    out = tmp_path / "hello.wav"
    args = argparse.Namespace(wyoming=uri, text="Hello. World", voice=None, wyoming_stream=True,
                              timeout_s=30.0, out=str(out))
    assert say_command(args) == 0
    line = capsys.readouterr().out
    assert "time to first audio" in line and "6 chunks" in line and out.is_file()
    spoken = run(synthesize(uri, "Plain one."))
    assert spoken.chunks == 3 and spoken.first_audio_ms is not None and spoken.first_audio_ms > 0
    from dataclasses import replace

    bound = replace(svc.settings, wyoming=replace(svc.settings.wyoming, uri=uri))
    checks = check_wyoming(bound)
    tts = next(c for c in checks if c.name == "Wyoming TTS")
    assert tts.ok and "answering (TTS cosyedge, 1 voice(s))" in tts.detail
    assert svc.health_doc()["wyoming"]["tts"]["served"] >= 2


def test_end_to_end_on_the_cosyvoice_tiny_bundle(daemons: DaemonFactory, tiny_bundle: Path) -> None:
    svc = daemons.start(local=load_synthesizer(tiny_bundle), fallback=None,
                        wyoming={"uri": "tcp://127.0.0.1:0", "zeroconf": "off"})
    got = run(exchange(tts_port(svc), [Synthesize(text="Hello from the tiny model, one two three.").event()],
                       ("audio-stop", "error"), timeout_s=120))
    kinds = [e.type for e in got]
    assert kinds[0] == "audio-start" and kinds[-1] == "audio-stop" and kinds.count("audio-chunk") >= 2, kinds
    pcm = np.frombuffer(b"".join(e.payload or b"" for e in got if e.type == "audio-chunk"), "<i2")
    assert pcm.size > 24000 and np.abs(pcm).max() > 0


class _VoicedEngine(FakeSynthesizer):
    name = "cosyvoice-ort"

    def voices(self) -> list[str]:
        return ["alice", "bob"]


def test_info_voices_and_voice_choice() -> None:
    from cosyedge_daemon.settings.schema import RoutingSettings
    from cosyedge_daemon.synthesizers.routing import SynthesizerSet
    from cosyedge_daemon.wyoming.info import build_info, voice_for
    from wyoming.tts import SynthesizeVoice

    engines = SynthesizerSet(RoutingSettings())
    engines.slots["local"].swap(_VoicedEngine())
    prog = build_info(engines, "1.2.3").tts[0]
    assert [v.name for v in prog.voices] == ["alice", "bob"] and prog.version == "1.2.3"
    assert all("en" in v.languages and "zh" in v.languages for v in prog.voices)
    assert voice_for(engines, SynthesizeVoice(name="bob")) == "bob"
    assert voice_for(engines, SynthesizeVoice(name="default")) is None
    assert voice_for(engines, SynthesizeVoice(language="zh")) == "alice"
    assert voice_for(engines, SynthesizeVoice(language="xx")) is None and voice_for(engines, None) is None


def test_cli_flags_parse() -> None:
    from cosyedge_daemon.cli.main import build_parser

    run_args = build_parser().parse_args(["run", "--wyoming-uri", "tcp://0.0.0.0:10200"])
    assert run_args.wyoming_uri == "tcp://0.0.0.0:10200"
    say_args = build_parser().parse_args(["say", "--wyoming", "tcp://h:10200", "--wyoming-stream", "Hi."])
    assert (say_args.wyoming, say_args.wyoming_stream, say_args.text) == ("tcp://h:10200", True, "Hi.")
