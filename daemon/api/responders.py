"""Answers on the native topics: audio chunks, done and error for a job,
mirrored to the requester's v5 ResponseTopic (with its CorrelationData)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np
from cosyedge_daemon.api.tts_messages import NO_ID, audio_payload, audio_properties, error_payload
from cosyedge_daemon.mqtt.connection import Reply
from cosyedge_daemon.serving.jobs import Job
from cosyedge_daemon.settings.topics import NativeTopics

log = logging.getLogger(__name__)


class Publisher(Protocol):
    v5: bool

    def publish(
        self,
        topic: str,
        payload: bytes | str,
        *,
        retain: bool = False,
        user_properties: Iterable[tuple[str, str]] = (),
        correlation_data: bytes | None = None,
        content_type: str | None = None,
        qos: int | None = None,
    ) -> Any: ...


class NativeResponder:
    def __init__(self, publisher: Publisher, topics: NativeTopics, audio_header: str = "auto") -> None:
        self.publisher = publisher
        self.topics = topics
        self.header = audio_header == "always" or (audio_header == "auto" and not publisher.v5)

    def _send(
        self,
        topic: str,
        payload: bytes,
        kind: str,
        request_id: str,
        reply: Reply | None,
        props: list[tuple[str, str]] | None = None,
        content_type: str | None = None,
    ) -> None:
        correlation = reply.correlation_data if reply else None
        self.publisher.publish(
            topic,
            payload,
            user_properties=props or [],
            correlation_data=correlation,
            content_type=content_type,
        )
        if reply is not None:
            mirror = [*(props or []), ("kind", kind), ("id", request_id)]
            self.publisher.publish(
                reply.topic,
                payload,
                user_properties=_unique(mirror),
                correlation_data=correlation,
                content_type=content_type,
            )

    def audio(self, job: Job, pcm: np.ndarray, sample_rate: int, seq: int, last: bool) -> None:
        payload = audio_payload(pcm, sample_rate, seq, last, self.header)
        self._send(
            self.topics.audio(job.id),
            payload,
            "audio",
            job.id,
            job.request.reply,
            audio_properties(sample_rate, seq, last, job.id),
            f"audio/L16;rate={sample_rate};channels=1",
        )

    def done(self, job: Job, summary: dict[str, Any]) -> None:
        self._send(
            self.topics.done(job.id),
            json.dumps(summary).encode(),
            "done",
            job.id,
            job.request.reply,
            content_type="application/json",
        )

    def error(self, job: Job, code: str, message: str) -> None:
        self.reject(job.id, code, message, job.request.reply)

    def reject(self, request_id: str | None, code: str, message: str, reply: Reply | None = None) -> None:
        """An error for a request that never became a job (or has no usable id)."""
        log.info("request %s: %s: %s", request_id or NO_ID, code, message)
        self._send(
            self.topics.error(request_id or NO_ID),
            error_payload(request_id, code, message),
            "error",
            request_id or NO_ID,
            reply,
            content_type="application/json",
        )


def _unique(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    for k, v in pairs:
        seen.setdefault(k, v)
    return list(seen.items())
