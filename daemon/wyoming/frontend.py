"""The Wyoming front end of `cosyedge run`: the event-loop thread, the TTS
listener (`[wyoming] uri`), the satellite listener (`[wyoming.satellite]
uri`) and their zeroconf adverts, put together from the daemon's own
admission, synthesizers and pipeline. Wiring only."""

from __future__ import annotations

import logging
from typing import Any

from cosyedge_daemon.api.vad_topics import VoiceLink
from cosyedge_daemon.serving.admission import Admission
from cosyedge_daemon.serving.channels import ChannelResponder, EventLoopThread
from cosyedge_daemon.serving.pipeline import Pipeline
from cosyedge_daemon.settings.schema import Settings
from cosyedge_daemon.settings.wyoming import parse_tcp_uri
from cosyedge_daemon.synthesizers.routing import SynthesizerSet
from cosyedge_daemon.wyoming.info import build_info, voice_for
from cosyedge_daemon.wyoming.satellite import Satellite
from cosyedge_daemon.wyoming.server import Listener
from cosyedge_daemon.wyoming.tts_server import TtsContext, TtsHandler
from cosyedge_daemon.wyoming.zeroconf import Advert, Advertiser, advertised_addresses, should_advertise

log = logging.getLogger(__name__)


def enabled(settings: Settings) -> bool:
    return bool(settings.wyoming.uri or settings.wyoming_satellite.uri)


class WyomingFrontend:
    def __init__(self, settings: Settings, admission: Admission, synthesizers: SynthesizerSet, pipeline: Pipeline,
                 voice: VoiceLink, version: str) -> None:
        self.settings = settings
        self.runtime = EventLoopThread("wyoming")
        self.responder = ChannelResponder()
        w = settings.wyoming
        self.tts: Listener | None = None
        self.satellite: Satellite | None = None
        self.satellite_listener: Listener | None = None
        self.advertiser: Advertiser | None = None
        if w.uri:
            host, port = parse_tcp_uri(w.uri, "[wyoming] uri")
            ctx = TtsContext(
                admission=admission, responder=self.responder, info=lambda: build_info(synthesizers, version),
                voice_for=lambda v: voice_for(synthesizers, v), priority=w.priority,
                max_buffered_bytes=lambda rate: int(w.max_buffered_audio_s * rate * 2),
            )
            self.tts = Listener("tts", host, port, lambda writer: TtsHandler(ctx, writer), w, w.idle_timeout_s)
        s = settings.wyoming_satellite
        if s.uri:
            host, port = parse_tcp_uri(s.uri, "[wyoming.satellite] uri")
            self.satellite = Satellite(s, settings.vad_settings, pipeline, voice, settings.device_id, version)
            # Home Assistant keeps its satellite connection open: no idle timeout there.
            self.satellite_listener = Listener("satellite", host, port, self.satellite.handler, w, None)

    @property
    def listeners(self) -> list[Listener]:
        return [x for x in (self.tts, self.satellite_listener) if x is not None]

    def start(self) -> None:
        self.runtime.start()
        if self.satellite is not None:
            self.satellite.bind(self.runtime.loop)
        for listener in self.listeners:
            self.runtime.call(listener.start())
        self._advertise()

    def _advertise(self) -> None:
        w = self.settings.wyoming
        base = w.zeroconf_name or f"cosyedge-{self.settings.device_id}"
        adverts = [
            Advert(base if x is self.tts else f"{base}-satellite", x.port, tuple(advertised_addresses(x.host)))
            for x in self.listeners if should_advertise(w.zeroconf, x.host)
        ]
        if not adverts:
            return
        self.advertiser = Advertiser(adverts)
        try:
            self.advertiser.start()
        except Exception as exc:  # no multicast route: serving matters more than discovery
            log.warning("zeroconf advertisement failed (%s); add cosyedge in Home Assistant by host and port",
                        exc)
            self.advertiser = None

    def stop(self) -> None:
        if self.advertiser is not None:
            self.advertiser.stop()
        if self.runtime.alive():
            for listener in self.listeners:
                try:
                    self.runtime.call(listener.stop())
                except Exception as exc:
                    log.warning("stopping the Wyoming %s listener: %s", listener.name, exc)
        self.runtime.stop()

    def alive(self) -> bool:
        return self.runtime.alive()

    def describe(self) -> dict[str, Any]:
        """For the health document and `cosyedge doctor`."""
        return {
            x.name: {"uri": f"tcp://{x.host}:{x.port}", "connections": len(x.connections),
                     "served": x.served, "refused": x.refused, "frame_errors": x.frame_errors}
            for x in self.listeners
        } | {"zeroconf": [a.name for a in self.advertiser.adverts] if self.advertiser else []}
