"""Rhasspy Hermes compatibility: `hermes/tts/say` for our siteIds is spoken
locally or published as one WAV on `hermes/audioServer/<siteId>/playBytes/
<id>`, then answered with `hermes/tts/sayFinished` (also after an error, as
Rhasspy's own TTS services do, so a dialogue manager never waits forever);
errors go to `hermes/error/tts`; VAD events become
`hermes/voiceActivity/<siteId>/vadUp|vadDown`."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from cosyedge_daemon.api.responders import Publisher
from cosyedge_daemon.api.tts_messages import decode_json_object
from cosyedge_daemon.audio.interfaces import VadEvent
from cosyedge_daemon.request.builder import build_request
from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.request.ids import sniff_field, valid_id
from cosyedge_daemon.request.request import RequestLimits, TtsRequest
from cosyedge_daemon.serving.jobs import Job
from cosyedge_models.pcm import wav_bytes

log = logging.getLogger(__name__)

SAY_TOPIC = "hermes/tts/say"
SAY_FINISHED_TOPIC = "hermes/tts/sayFinished"
ERROR_TOPIC = "hermes/error/tts"
_MAX_WAV_S = 600.0  # one playBytes message holds at most this much audio


@dataclass(frozen=True)
class HermesSay:
    request: TtsRequest
    site_id: str
    session_id: str | None
    hermes_id: str | None  # echoed back as given (may be null)


def parse_hermes_say(
    payload: bytes, limits: RequestLimits, site_ids: tuple[str, ...], output: str, received_at: float
) -> HermesSay | None:
    """The request; None when it is for another site (or its site cannot be
    read and is not ours: Hermes' default siteId is "default"); HermesError,
    with the siteId, sessionId and id when known, when it is malformed."""
    try:
        obj = decode_json_object(payload, limits.max_payload_bytes)
    except ApiError as exc:
        site = sniff_field(payload, "siteId") or "default"
        if site not in site_ids:
            return None
        raise HermesError(exc.message, site, sniff_field(payload, "sessionId"), sniff_field(payload, "id")) from None
    site_id = obj.get("siteId", "default")
    if not isinstance(site_id, str) or site_id not in site_ids:
        return None
    session_id = obj.get("sessionId")
    session_id = session_id if isinstance(session_id, str) else None
    hermes_id = obj.get("id")
    hermes_id = hermes_id if isinstance(hermes_id, str) else None
    text = obj.get("text")
    if not isinstance(text, str):
        raise HermesError("'text' must be a non-empty string", site_id, session_id, hermes_id)
    rid = hermes_id if hermes_id is not None and valid_id(hermes_id) else None
    try:
        request = build_request(
            limits, text, request_id=rid, output="play" if output == "play" else "publish", received_at=received_at
        )
    except ApiError as exc:
        raise HermesError(exc.message, site_id, session_id, hermes_id) from None
    return HermesSay(request, site_id, session_id, hermes_id)


class HermesError(ApiError):
    def __init__(self, message: str, site_id: str, session_id: str | None, hermes_id: str | None = None) -> None:
        super().__init__("invalid_request", message)
        self.site_id = site_id
        self.session_id = session_id
        self.hermes_id = hermes_id  # echoed in sayFinished, as given


def publish_error(
    publisher: Publisher, message: str, site_id: str, session_id: str | None, context: str | None = None
) -> None:
    payload = {"error": message, "siteId": site_id, "context": context, "sessionId": session_id}
    publisher.publish(ERROR_TOPIC, json.dumps(payload))


def publish_say_finished(
    publisher: Publisher, hermes_id: str | None, site_id: str, session_id: str | None
) -> None:
    publisher.publish(
        SAY_FINISHED_TOPIC, json.dumps({"id": hermes_id, "siteId": site_id, "sessionId": session_id})
    )


class HermesResponder:
    """The answers of one Hermes say (one instance per request)."""

    def __init__(self, publisher: Publisher, say: HermesSay) -> None:
        self.publisher = publisher
        self.say = say
        self._pcm: list[np.ndarray] = []
        self._samples = 0

    def audio(self, job: Job, pcm: np.ndarray, sample_rate: int, seq: int, last: bool) -> None:
        if self._samples + pcm.size > _MAX_WAV_S * sample_rate:
            job.stop("cancelled")
            return
        self._pcm.append(pcm)
        self._samples += pcm.size

    def done(self, job: Job, summary: dict[str, Any]) -> None:
        s = self.say
        if job.publishes and self._pcm:
            play_id = s.hermes_id if valid_id(s.hermes_id) else job.id
            wav = wav_bytes(np.concatenate(self._pcm), job.sample_rate)
            self.publisher.publish(f"hermes/audioServer/{s.site_id}/playBytes/{play_id}", wav)
            self._pcm.clear()
        publish_say_finished(self.publisher, s.hermes_id, s.site_id, s.session_id)

    def error(self, job: Job, code: str, message: str) -> None:
        s = self.say
        publish_error(self.publisher, f"{code}: {message}", s.site_id, s.session_id, context=s.hermes_id)
        publish_say_finished(self.publisher, s.hermes_id, s.site_id, s.session_id)


def publish_voice_activity(publisher: Publisher, site_id: str, event: VadEvent) -> None:
    """vadUp on speech_start, vadDown on speech_end (Snips/Rhasspy Hermes)."""
    kind = "vadUp" if event.kind == "speech_start" else "vadDown"
    payload = {"siteId": site_id, "signalMs": int(round(event.time_s * 1000.0))}
    publisher.publish(f"hermes/voiceActivity/{site_id}/{kind}", json.dumps(payload), qos=0)
