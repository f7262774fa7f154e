"""The cloud as an Synthesizer on the device: a request goes to the cloud bridge
over the daemon's own MQTT connection, the audio comes back chunk by chunk
on the device's response topic (protocol: cloud_bridge/wire/protocol.py, numpy
only).

* The request is published with QoS 1 and a v5 message expiry from its
  deadline, and always with a seed: a request the bridge redelivers after a
  crash is synthesized again identically from the start, and chunks already
  received (by `seq`) are skipped.
* What the router should treat as "the cloud failed, fall back" raises
  CloudUnavailable: retryable bridge errors (busy, unavailable, timeout,
  draining), deadline/model errors, no first chunk in time, a stalled
  stream, no broker connection, the link down. A request the cloud rejects
  for itself (unknown voice, bad request) raises RequestError: no fallback.
* Health: the retained link topic a device-side Mosquitto bridge publishes
  (`notification_topic`, "1" up / "0" down); without one (a direct
  connection) the broker connection alone counts.
* The MQTT callback (`on_message`) only decodes and queues."""

from __future__ import annotations

import logging
import math
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator

from cosyedge_cloud.wire.protocol import (
    MODES,
    AudioMessage,
    CloudPrompt,
    CloudRequest,
    CloudTopics,
    DoneMessage,
    ErrorMessage,
    ProtocolError,
    ResponseMessage,
    decode_response,
    now_unix_ms,
)
from cosyedge_daemon.mqtt.connection import InboundMessage, MqttConnection
from cosyedge_daemon.settings.schema import CloudSettings
from cosyedge_models.errors import RequestError, SynthesisError
from cosyedge_models.synthesis.api import AudioChunk, LoadLevel, Mode, StageTimes, SynthesisRequest, SynthesizeFn

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting request looks at its cancel flag
# Bridge error codes that mean "this cloud cannot do it now", not "this request is wrong".
FALLBACK_CODES = frozenset(
    {"busy", "draining", "unavailable", "timeout", "expired", "deadline_exceeded", "model_error"}
)


class CloudUnavailable(SynthesisError):
    """The cloud did not serve the request (unreachable, too slow, failing);
    the router falls back."""


class CloudSynthesizer:
    name = "cloud"

    def __init__(
        self,
        conn: MqttConnection,
        device_id: str,
        settings: CloudSettings,
        sample_rate: int = 24000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conn = conn
        self.device_id = device_id
        self.settings = settings
        self.sample_rate = sample_rate  # updated from the chunks
        self.topics = CloudTopics(settings.topic_root)
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, queue.Queue[ResponseMessage]] = {}
        self.link_up: bool | None = None  # None: no link topic seen (a direct connection)
        self._response_prefix = self.topics.response(device_id, "")
        self._link_topic = self.topics.link(device_id)

    # --- MQTT side (paho's thread) -------------------------------------------------
    def subscriptions(self) -> list[str]:
        return [self.topics.response_filter(self.device_id), self._link_topic]

    def handles(self, topic: str) -> bool:
        return topic == self._link_topic or topic.startswith(self._response_prefix)

    def on_message(self, msg: InboundMessage) -> None:
        if msg.topic == self._link_topic:
            state = msg.payload.strip()
            up = None if not state else state != b"0"  # empty: the retained state was cleared
            if up != self.link_up:
                log.info("cloud link %s", {None: "unknown", True: "up", False: "down"}[up])
            self.link_up = up
            return
        rid = self.topics.request_of_response(self.device_id, msg.topic)
        if rid is None:
            return
        with self._lock:
            pending = self._pending.get(rid)
        if pending is None:  # a late chunk or done of a request that ended (or fell back)
            log.debug("cloud response for %s, which is not waiting", rid)
            return
        try:
            pending.put_nowait(decode_response(msg.payload, list(msg.user_properties), rid))
        except ProtocolError as exc:
            log.warning("malformed cloud response on %s: %s", msg.topic, exc)

    # --- Synthesizer -------------------------------------------------------------------------
    def available(self) -> bool:
        """The router's view: connected and the bridge link (if any) up."""
        return self.conn.connected.is_set() and self.link_up is not False

    def voices(self) -> list[str]:
        return []  # the cloud's voices are the bridge's business; it answers unknown_voice

    def modes(self) -> tuple[Mode, ...]:
        return MODES

    def validate(self, request: SynthesisRequest) -> None:
        return None  # the bridge validates (and the router sends only what it may)

    def set_load_level(self, level: LoadLevel) -> None:
        return None

    def concurrent_streams(self) -> int | None:
        return None  # the bridge and Triton queue what they cannot take at once

    def close(self) -> None:
        with self._lock:
            self._pending.clear()

    def for_job(self, job_id: str, deadline_at: float | None, *, validated: bool = False) -> SynthesizeFn:
        """`synthesize` for one daemon job: its id and deadline go to the cloud."""

        def synth(request: SynthesisRequest, cancel: threading.Event | None = None) -> Iterator[AudioChunk]:
            return self.synthesize(request, cancel, request_id=job_id, deadline_at=deadline_at)

        return synth

    def synthesize(
        self,
        request: SynthesisRequest,
        cancel: threading.Event | None = None,
        *,
        request_id: str | None = None,
        deadline_at: float | None = None,
    ) -> Iterator[AudioChunk]:
        rid = request_id or uuid.uuid4().hex
        cloud_request, expiry_s = self._request(rid, request, deadline_at)
        inbox: queue.Queue[ResponseMessage] = queue.Queue()
        with self._lock:
            if rid in self._pending:
                raise RequestError("duplicate", f"a cloud request with id {rid} is in progress")
            self._pending[rid] = inbox
        try:
            yield from self._exchange(cloud_request, expiry_s, inbox, cancel, deadline_at)
        finally:
            with self._lock:
                self._pending.pop(rid, None)

    def _request(
        self, rid: str, request: SynthesisRequest, deadline_at: float | None
    ) -> tuple[CloudRequest, int]:
        expiry_s = self.settings.request_expiry_s
        deadline_unix_ms = None
        if deadline_at is not None:
            left_s = deadline_at - self._clock()
            if left_s <= 0:
                raise CloudUnavailable("the deadline passed before the request could go to the cloud")
            deadline_unix_ms = now_unix_ms() + int(left_s * 1000)
            expiry_s = max(1, math.ceil(left_s))
        prompt = None
        if request.prompt is not None:
            p = request.prompt
            prompt = CloudPrompt(p.pcm, p.sample_rate, p.text)
        seed = request.seed if request.seed is not None else random.randrange(2**31)
        return (
            CloudRequest(
                id=rid,
                text=request.text,
                mode=request.mode,
                voice=request.voice,
                instruct_text=request.instruct_text,
                prompt=prompt,
                model_version=self.settings.model_version or None,
                deadline_unix_ms=deadline_unix_ms,
                stream=request.stream,
                seed=seed,
                speed=request.speed,
                audio_header=not self.conn.v5,
                sent_unix_ms=now_unix_ms(),
            ),
            expiry_s,
        )

    def _exchange(
        self,
        cloud_request: CloudRequest,
        expiry_s: int,
        inbox: queue.Queue[ResponseMessage],
        cancel: threading.Event | None,
        deadline_at: float | None,
    ) -> Iterator[AudioChunk]:
        s = self.settings
        if not self.conn.connected.is_set():
            raise CloudUnavailable("no connection to the MQTT broker")
        if self.link_up is False:
            raise CloudUnavailable("the link to the cloud broker is down")
        sent = self._clock()
        self.conn.publish(
            self.topics.request(self.device_id), cloud_request.to_json(), qos=1, message_expiry_s=expiry_s
        )
        first_by = sent + s.first_chunk_timeout_s
        if deadline_at is not None:
            first_by = min(first_by, deadline_at)
        next_seq, last_progress = 0, sent
        times = StageTimes()
        while True:
            due = first_by if next_seq == 0 else last_progress + s.chunk_timeout_s
            left = due - self._clock()
            if left <= 0:
                if next_seq == 0:
                    raise CloudUnavailable(f"no audio from the cloud within {(due - sent) * 1000:.0f} ms")
                raise CloudUnavailable(f"the cloud stream stalled after {next_seq} chunks")
            try:
                msg = inbox.get(timeout=min(left, _POLL_S))
            except queue.Empty:
                if cancel is not None and cancel.is_set():
                    return
                continue
            if isinstance(msg, AudioMessage):
                if msg.seq < next_seq:  # a redelivered request resynthesized from the start
                    continue
                if msg.seq > next_seq:
                    raise CloudUnavailable(f"cloud chunks {next_seq}..{msg.seq - 1} went missing")
                now = self._clock()
                if next_seq == 0:
                    times.first_audio_ms = (now - sent) * 1000.0
                next_seq, last_progress = next_seq + 1, now
                self.sample_rate = msg.sample_rate
                yield AudioChunk(msg.pcm(), msg.sample_rate, msg.seq, msg.last, _copy(times))
                if msg.last:
                    return
            elif isinstance(msg, DoneMessage):
                if next_seq == 0:
                    raise CloudUnavailable("the cloud answered done without audio")
                return
            elif isinstance(msg, ErrorMessage):
                raise _error(msg)


def _copy(times: StageTimes) -> StageTimes:
    return StageTimes(first_audio_ms=times.first_audio_ms)


def _error(msg: ErrorMessage) -> Exception:
    text = f"cloud error {msg.code}: {msg.message}"
    if msg.retryable or msg.code in FALLBACK_CODES:
        return CloudUnavailable(text)
    return RequestError(msg.code, text)


def describe_link(engine: CloudSynthesizer | None) -> str:
    """'up', 'down' or 'unknown' (no cloud engine, or no link state seen) for the health JSON."""
    up = None if engine is None else engine.link_up
    return "unknown" if up is None else ("up" if up else "down")
