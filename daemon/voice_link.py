"""The daemon's side of the microphone path: what the audio side's VAD
worker calls (`on_vad_event`, `on_utterance`) and what it reads (`speaking`,
for half-duplex). VAD events are published on `<prefix>/vad/event` and as
Hermes voiceActivity, utterance WAVs on `<prefix>/vad/segment`, and speech
while the daemon speaks is a barge-in: the playing request is stopped (done
with reason `interrupted`) or the output ducked until the speech ends."""

from __future__ import annotations

import json
import logging
from typing import Literal, Protocol

from daemon.audio.interfaces import VadEvent
from daemon.hermes import publish_voice_activity
from daemon.metrics import Metrics
from daemon.pipeline import Pipeline
from daemon.responders import Publisher

log = logging.getLogger(__name__)

Action = Literal["stop", "duck", "unduck", "none"]


class BargeInPolicy(Protocol):
    def decide(self, event: VadEvent, speaking: bool) -> Action: ...


class SimpleBargeIn:
    """stop: speech while speaking stops the request; duck: lowers the volume
    until the speech ends; off: nothing. (The audio side may supply its own
    policy with the same `decide`.)"""

    def __init__(self, mode: str = "stop") -> None:
        self.mode = mode
        self._ducked = False

    def decide(self, event: VadEvent, speaking: bool) -> Action:
        if event.kind == "speech_end":
            if self._ducked:
                self._ducked = False
                return "unduck"
            return "none"
        if not speaking or self.mode == "off":
            return "none"
        if self.mode == "duck":
            self._ducked = True
            return "duck"
        return "stop"


class VoiceLink:
    def __init__(
        self,
        publisher: Publisher,
        prefix: str,
        pipeline: Pipeline,
        metrics: Metrics | None,
        policy: BargeInPolicy,
        hermes_site: str | None,
        duck_gain: float = 0.25,
    ) -> None:
        self.publisher = publisher
        self.prefix = prefix
        self.pipeline = pipeline
        self.metrics = metrics
        self.policy = policy
        self.hermes_site = hermes_site
        self.duck_gain = duck_gain

    @property
    def speaking(self) -> bool:
        """Half-duplex: true while the daemon's own voice is playing."""
        return self.pipeline.speaking

    def on_vad_event(self, event: VadEvent) -> None:
        speaking = self.pipeline.speaking
        doc = {
            "event": event.kind,
            "time_s": round(event.time_s, 3),
            "utterance_ms": event.utterance_ms,
            "speaking": speaking,
        }
        self.publisher.publish(f"{self.prefix}/vad/event", json.dumps(doc), qos=0)
        if self.hermes_site is not None:
            publish_voice_activity(self.publisher, self.hermes_site, event)
        if self.metrics is not None:
            self.metrics.vad_events.labels(kind=event.kind).inc()
        action = self.policy.decide(event, speaking)
        if action == "none":
            return
        if self.metrics is not None and action in ("stop", "duck"):
            self.metrics.barge_ins.labels(action=action).inc()
        sink = self.pipeline.sink
        if action == "stop":
            job = self.pipeline.interrupt_playing("interrupted")
            log.info("barge-in: stopped %s", job.id if job else "nothing")
        elif action == "duck" and sink is not None:
            sink.set_gain(self.duck_gain)
        elif action == "unduck" and sink is not None:
            sink.set_gain(1.0)

    def on_utterance(self, wav: bytes) -> None:
        self.publisher.publish(f"{self.prefix}/vad/segment", wav, content_type="audio/wav")
