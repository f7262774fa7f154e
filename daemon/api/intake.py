"""The MQTT front end's way in: `on_message` runs on paho's network thread
and only parses and queues (bounded); the intake thread then hands each
request to serving's one admission path (serving/admission.py), which
answers it from then on. Only what never became a request (a payload that
does not parse, a refused ResponseTopic) is answered here."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cosyedge_daemon.api.hermes import (
    SAY_TOPIC,
    HermesError,
    HermesResponder,
    HermesSay,
    parse_hermes_say,
    publish_error,
    publish_say_finished,
)
from cosyedge_daemon.api.request_policy import ResponseTopicPolicy
from cosyedge_daemon.api.responders import NativeResponder, Publisher
from cosyedge_daemon.api.tts_messages import parse_cancel, parse_say
from cosyedge_daemon.mqtt.connection import InboundMessage, Reply
from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.request.ids import leading_id, sniff_field
from cosyedge_daemon.request.request import TtsRequest
from cosyedge_daemon.serving.admission import Admission
from cosyedge_daemon.serving.jobs import Responder
from cosyedge_daemon.serving.metrics import Metrics
from cosyedge_daemon.settings.schema import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Say:
    request: TtsRequest
    hermes: HermesSay | None = None


@dataclass(frozen=True)
class _Reject:
    request_id: str | None
    code: str
    message: str
    reply: Reply | None


@dataclass(frozen=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True)
class _Reload:
    bundle: str | None


_Item = _Say | _Reject | _Cancel | _Reload | HermesError


class Intake:
    def __init__(
        self,
        settings: Settings,
        admission: Admission,
        publisher: Publisher,
        native: NativeResponder,
        metrics: Metrics | None,
        on_reload: Callable[[str | None], object],
    ) -> None:
        self.admission = admission
        self.publisher = publisher
        self.native = native
        self.metrics = metrics
        self.on_reload = on_reload
        self.topics = settings.topics
        self.has_sink = admission.has_sink
        self._input_topics: list[str] = []
        self.reconfigure(settings)
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=settings.mqtt.inbound_queue)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.heartbeat = time.monotonic()

    def reconfigure(self, settings: Settings) -> None:
        self.settings = settings
        self.set_input_topics(self._input_topics)

    def set_input_topics(self, topics: list[str]) -> None:
        """Every topic the daemon subscribes to (also the cloud's): no ResponseTopic may be one of them."""
        self._input_topics = list(topics)
        self.response_policy = ResponseTopicPolicy(
            [*self.subscriptions(), *topics],
            self.settings.mqtt.response_topic_prefix,
            self.topics.reserved(),
        )

    def subscriptions(self) -> list[str]:
        topics = [self.topics.say, self.topics.cancel, self.topics.reload]
        return topics + ([SAY_TOPIC] if self.settings.hermes.enabled else [])

    # --- paho's thread: parse and queue --------------------------------------------
    def on_message(self, msg: InboundMessage) -> None:
        item = self._parse(msg)
        if item is None:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            log.warning("inbound queue full; answering busy")
            if isinstance(item, _Say) and item.hermes is None:
                self.native.reject(
                    item.request.id,
                    "busy",
                    "the daemon is overloaded (inbound queue full)",
                    item.request.reply,
                )

    def _parse(self, msg: InboundMessage) -> _Item | None:
        reply, reply_problem = None, None
        if msg.response_topic:
            reply_problem = self.response_policy.problem(msg.response_topic)
            if reply_problem is None:
                reply = Reply(msg.response_topic, msg.correlation_data)
        try:
            if msg.topic == self.topics.say:
                request = parse_say(msg.payload, self.admission.limits, reply=reply, received_at=msg.received_at)
                if reply_problem is not None:  # answered on the native topics only
                    return _Reject(request.id, "invalid_response_topic", reply_problem, None)
                return _Say(request)
            if msg.topic == self.topics.cancel:
                return _Cancel(parse_cancel(msg.payload, self.admission.limits.max_payload_bytes))
            if msg.topic == self.topics.reload:
                return _Reload(_reload_bundle(msg.payload))
            if msg.topic == SAY_TOPIC:
                # no speaker here: hand Hermes the WAV instead
                output = self.settings.hermes.output if self.has_sink else "publish"
                say = parse_hermes_say(
                    msg.payload, self.admission.limits, self.settings.site_ids, output, msg.received_at
                )
                return None if say is None else _Say(say.request, say)
        except HermesError as exc:
            return exc
        except ApiError as exc:
            return _Reject(exc.request_id, exc.code, exc.message, reply)
        except Exception:  # a parser bug must still answer the request, once
            log.exception("parsing a message on %s failed", msg.topic)
            return self._unparsed(msg, reply)
        log.debug("ignoring a message on %s", msg.topic)
        return None

    def _unparsed(self, msg: InboundMessage, reply: Reply | None) -> _Item | None:
        message = "the request could not be parsed (internal error; see the daemon's log)"
        if msg.topic != SAY_TOPIC:
            return _Reject(leading_id(msg.payload), "invalid_request", message, reply)
        site = sniff_field(msg.payload, "siteId") or "default"
        if site not in self.settings.site_ids:
            return None
        return HermesError(message, site, sniff_field(msg.payload, "sessionId"), sniff_field(msg.payload, "id"))

    # --- the intake thread -------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="intake", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def alive(self, stall_s: float) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and time.monotonic() - self.heartbeat < stall_s
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self.heartbeat = time.monotonic()
            try:
                item = self._queue.get(timeout=0.25)
            except queue.Empty:
                continue
            try:
                self.handle(item)
            except Exception:
                log.exception("handling %s failed", type(item).__name__)

    def handle(self, item: _Item) -> None:
        if isinstance(item, _Say):
            self._say(item)
        elif isinstance(item, _Reject):
            self._rejected(item.code)
            self.native.reject(item.request_id, item.code, item.message, item.reply)
        elif isinstance(item, _Cancel):
            self.admission.cancel(item.request_id)
        elif isinstance(item, _Reload):
            self.on_reload(item.bundle)
        elif isinstance(item, HermesError):
            self._rejected(item.code)
            publish_error(self.publisher, item.message, item.site_id, item.session_id, context=item.hermes_id)
            publish_say_finished(self.publisher, item.hermes_id, item.site_id, item.session_id)

    def _rejected(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(code=code).inc()

    def _say(self, item: _Say) -> None:
        responder: Responder = (
            HermesResponder(self.publisher, item.hermes) if item.hermes is not None else self.native
        )
        self.admission.admit(item.request, responder)


def _reload_bundle(payload: bytes) -> str | None:
    """admin/reload: empty, or {"bundle": "/path"} to switch bundles."""
    if not payload.strip():
        return None
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: also over-long integers
        raise ApiError("invalid_json", 'admin/reload takes an empty payload or {"bundle": "/path"}') from None
    if not isinstance(obj, dict):
        raise ApiError("invalid_request", 'admin/reload takes an empty payload or {"bundle": "/path"}')
    bundle = obj.get("bundle")
    if bundle is not None and not isinstance(bundle, str):
        raise ApiError("invalid_field", "'bundle' must be a string")
    return bundle
