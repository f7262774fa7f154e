"""Fixtures of the daemon suite: the engine under test (espeak-ng now; add
the CosyVoice tiny bundle as one more param), an in-process daemon on the
real Mosquitto of the `broker` fixture, and a probe client."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from cosyedge_daemon.audio.interfaces import AudioSink
from cosyedge_daemon.service.service import Service
from cosyedge_daemon.settings.loader import settings_from_mapping
from cosyedge_daemon.settings.schema import Settings
from cosyedge_daemon.synthesizers.espeak import EspeakSynthesizer
from cosyedge_models.synthesis.api import Synthesizer

from tests.support.broker import Broker
from tests.support.components import require_binary
from tests.support.mqtt_recorder import Recorder

SynthesizerFactory = Callable[[], Synthesizer]


def _espeak() -> Synthesizer:
    require_binary("espeak-ng", "apt-get install espeak-ng")
    return EspeakSynthesizer(voice="en-us", sample_rate=24000)


# The engine the daemon serves with in these tests. To run the suite on the
# CosyVoice tiny bundle too, add a param that loads it (cosyedge_models.synthesis.synthesizer.load_synthesizer).
@pytest.fixture(params=["espeak-ng"])
def engine_factory(request: pytest.FixtureRequest) -> SynthesizerFactory:
    return {"espeak-ng": _espeak}[request.param]


@pytest.fixture()
def fallback_factory() -> SynthesizerFactory:
    return _espeak


def make_settings(broker_url: str, device_id: str | None = None, **sections: dict[str, Any]) -> Settings:
    data: dict[str, Any] = {"device_id": device_id or f"t{uuid.uuid4().hex[:8]}"}
    data.update({k: dict(v) for k, v in sections.items()})
    data.setdefault("mqtt", {})["broker"] = broker_url
    data.setdefault("health", {}).setdefault("metrics_port", 0)
    data["health"].setdefault("stop_timeout_s", 5.0)
    return settings_from_mapping(data)


class DaemonFactory:
    def __init__(
        self, broker: Broker, engine_factory: SynthesizerFactory, fallback_factory: SynthesizerFactory
    ) -> None:
        self.broker = broker
        self.engine_factory = engine_factory
        self.fallback_factory = fallback_factory
        self.services: list[Service] = []
        self.probes: list[Recorder] = []

    def start(
        self,
        *,
        sink: AudioSink | None = None,
        local: Synthesizer | None | str = "default",
        fallback: Synthesizer | None | str = "default",
        settings: Settings | None = None,
        **sections: dict[str, Any],
    ) -> Service:
        settings = settings or make_settings(self.broker.url, **sections)
        service = Service(settings, sink=sink)
        service.set_synthesizers(
            self.engine_factory() if local == "default" else local,  # type: ignore[arg-type]
            self.fallback_factory() if fallback == "default" else fallback,
        )  # type: ignore[arg-type]
        service.start(connect_timeout_s=10)
        self.services.append(service)
        return service

    def probe(self, service: Service, extra_topics: tuple[str, ...] = (), protocol: str = "5") -> Recorder:
        prefix = service.settings.topic_prefix
        probe = Recorder(
            self.broker.url,
            [f"{prefix}/tts/#", f"{prefix}/status/#", f"{prefix}/status", f"{prefix}/vad/#", *extra_topics],
            protocol=protocol,
        )
        self.probes.append(probe)
        return probe

    def close(self) -> None:
        for p in self.probes:
            p.close()
        for s in self.services:
            if s.state != "stopped":
                s.stop(timeout_s=1.0)


@pytest.fixture()
def daemons(
    broker: Broker, engine_factory: SynthesizerFactory, fallback_factory: SynthesizerFactory
) -> Iterator[DaemonFactory]:
    factory = DaemonFactory(broker, engine_factory, fallback_factory)
    try:
        yield factory
    finally:
        factory.close()


def with_section(settings: Settings, section: str, **changes: Any) -> Settings:
    return replace(settings, **{section: replace(getattr(settings, section), **changes)})
