"""The daemon's side of the microphone path: what the audio side's VAD
worker calls (`on_vad_event`, `on_utterance`) and what it reads (`speaking`,
for half-duplex). VAD events are published on `<prefix>/vad/event` and as
Hermes voiceActivity, utterance WAVs on `<prefix>/vad/segment`, and speech
while the daemon speaks is a barge-in: the playing request is stopped (done
with reason `interrupted`) or the output ducked until the speech ends."""

from __future__ import annotations

import json
import logging

from cosyedge_daemon.api.hermes import publish_voice_activity
from cosyedge_daemon.api.responders import Publisher
from cosyedge_daemon.audio.barge_in import BargeInAction, BargeInPolicy
from cosyedge_daemon.audio.interfaces import VadEvent
from cosyedge_daemon.serving.metrics import Metrics
from cosyedge_daemon.serving.pipeline import Pipeline
from cosyedge_daemon.settings.topics import NativeTopics

log = logging.getLogger(__name__)

class VoiceLink:
    def __init__(
        self,
        publisher: Publisher,
        topics: NativeTopics,
        pipeline: Pipeline,
        metrics: Metrics | None,
        policy: BargeInPolicy,
        hermes_site: str | None,
    ) -> None:
        self.publisher = publisher
        self.topics = topics
        self.pipeline = pipeline
        self.metrics = metrics
        self.policy = policy
        self.hermes_site = hermes_site

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
        self.publisher.publish(self.topics.vad_event, json.dumps(doc), qos=0)
        if self.hermes_site is not None:
            publish_voice_activity(self.publisher, self.hermes_site, event)
        if self.metrics is not None:
            self.metrics.vad_events.labels(kind=event.kind).inc()
        self._apply(self.policy.on_vad_event(event, speaking))

    def on_speaking_changed(self, speaking: bool) -> None:
        """Playback ended while ducked: restore the gain for the next request."""
        self._apply(self.policy.on_speaking_changed(speaking))

    def _apply(self, action: BargeInAction) -> None:
        if action.kind == "none":
            return
        if self.metrics is not None and action.kind in ("stop", "duck"):
            self.metrics.barge_ins.labels(action=action.kind).inc()
        sink = self.pipeline.sink
        if action.kind == "stop":
            job = self.pipeline.interrupt_playing("interrupted")
            log.info("barge-in: stopped %s", job.id if job else "nothing")
        elif sink is not None:  # duck / unduck
            sink.set_gain(action.gain)

    def on_utterance(self, wav: bytes) -> None:
        self.publisher.publish(self.topics.vad_segment, wav, content_type="audio/wav")
