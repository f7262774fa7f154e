"""The cloud bridge: takes synthesis requests from devices over MQTT,
streams them from Triton, publishes every audio chunk to the requesting
device's response topic as it arrives (protocol: cloud_bridge/wire/protocol.py).

* One MQTT v5 connection with a fixed client id and a persistent session; a
  shared subscription so replicas split the requests. Requests are
  acknowledged (manual PUBACK) only once answered, so a request this bridge
  took and did not answer (it crashed) is delivered again to its session.
* The paho callbacks only parse, check and queue. A pool of
  `limits.max_in_flight` workers runs the Triton streams; at most
  `max_in_flight + max_queued` requests are held. When full: `busy` errors
  (overflow = "busy"), or the broker holds the rest (overflow = "wait": the
  MQTT v5 Receive Maximum is the cap, so the broker stops sending).
* Deadlines: a request's message expiry and its `deadline_unix_ms` give the
  time its first audio is due; past it before synthesis starts: `expired`,
  not synthesized; no first chunk by then: the Triton request is cancelled,
  `deadline_exceeded`.
* Authorization: responses go to the device of the topic the request came
  in on (the broker lets only that device's user write it), never to a
  device named in the payload.
* stop(): drain. Unsubscribe, answer late arrivals `draining`, let held
  requests finish within `limits.drain_timeout_s`, cancel the rest with a
  `draining` error, wait for the broker's acknowledgements, disconnect.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import paho.mqtt.client as mqtt
from cosyedge_cloud.bridge.admission import Admission, Key, Verdict
from cosyedge_cloud.bridge.jobs import Job, first_chunk_deadline
from cosyedge_cloud.bridge.metrics import BridgeMetrics
from cosyedge_cloud.bridge.settings import BridgeSettings
from cosyedge_cloud.bridge.versions import VersionSelector
from cosyedge_cloud.triton.stream import SynthesisFailed, TritonStreamer
from cosyedge_cloud.wire.mqtt import (
    MqttOptions,
    connect,
    make_client,
    publish_properties,
    received_properties,
)
from cosyedge_cloud.wire.protocol import (
    CloudTopics,
    ProtocolError,
    encode_audio,
    encode_done,
    encode_error,
    parse_request,
    peek_request_id,
)
from paho.mqtt.subscribeoptions import SubscribeOptions

log = logging.getLogger(__name__)


class BridgeService:
    def __init__(
        self,
        settings: BridgeSettings,
        streamer: Any = None,
        metrics: BridgeMetrics | None = None,
        selector: VersionSelector | None = None,
    ) -> None:
        self.settings = settings
        t, lim = settings.triton, settings.limits
        self.topics = CloudTopics(settings.mqtt.topic_root)
        self.metrics = metrics or BridgeMetrics()
        self.streamer = streamer if streamer is not None else TritonStreamer(t)
        self.selector = selector or VersionSelector(
            t.default_version,
            t.canary_version,
            t.canary_share,
            t.allowed_versions,
            seed=None if t.canary_seed < 0 else t.canary_seed,
        )
        self.admission = Admission(lim.max_in_flight + lim.max_queued, lim.dedupe_max_ids)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._running: dict[Key, Job] = {}
        self._running_lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._pubs: deque[mqtt.MQTTMessageInfo] = deque(maxlen=10000)  # for the drain's wait only
        self._pubs_lock = threading.Lock()
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self._metrics_server: Any = None
        self._epoch = 0
        self._stopped = False
        self._client = self._make_client()

    # --- MQTT ---------------------------------------------------------------------------------
    def _mqtt_options(self) -> MqttOptions:
        """A persistent v5 session; deliveries acknowledged once handled."""
        m = self.settings.mqtt
        return m.options(
            m.client_id, receive_maximum=self._receive_maximum(), reconnect_min_delay_s=1, reconnect_max_delay_s=30,
            manual_ack=True,
        )

    def _make_client(self) -> mqtt.Client:
        client = make_client(self._mqtt_options())
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        return client

    def _receive_maximum(self) -> int:
        lim = self.settings.limits
        cap = lim.max_in_flight + lim.max_queued
        # "wait": the broker never has more than `cap` requests out to us, the rest waits there.
        return min(65535, cap if lim.overflow == "wait" else max(256, 4 * cap))

    def _on_connect(self, client: mqtt.Client, _u: Any, flags: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            log.error("broker refused the connection: %s", reason)
            return
        if not flags.session_present:
            self._epoch += 1  # a new session: message ids of deliveries taken before mean nothing now
        self.metrics.connected.set(1)
        self._connected.set()
        log.info(
            "connected to %s as %s (session present: %s)",
            self.settings.mqtt.broker,
            self.settings.mqtt.client_id,
            flags.session_present,
        )
        if not self.admission.draining:
            filt = self.topics.shared_request_filter(self.settings.mqtt.share_group)
            client.subscribe(filt, options=SubscribeOptions(qos=1))

    def _on_subscribe(self, _c: mqtt.Client, _u: Any, _mid: int, reasons: list[Any], _p: Any) -> None:
        if any(r.is_failure for r in reasons):
            log.error(
                "the broker refused the request subscription: %s (check the bridge user's ACL: topic read %s)",
                reasons,
                self.topics.request_filter(),
            )
            return
        self._subscribed.set()

    def _on_disconnect(self, _c: mqtt.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        self.metrics.connected.set(0)
        self._connected.clear()
        self._subscribed.clear()
        if not self.admission.draining:
            log.warning("disconnected from the broker (%s); reconnecting", reason)

    def _ack(self, mid: int, qos: int = 1) -> None:
        if qos > 0:
            self._client.ack(mid, qos)

    def _ack_later(self, tag: tuple[int, int, int]) -> None:
        """Acknowledge a delivery taken earlier, unless the broker forgot the
        session since (its message ids were reused for other messages then)."""
        epoch, mid, qos = tag
        if epoch == self._epoch:
            self._ack(mid, qos)

    def _publish(
        self, topic: str, payload: bytes, user_props: list[tuple[str, str]], correlation: bytes | None = None
    ) -> None:
        props = publish_properties(
            user_properties=user_props, correlation_data=correlation,
            message_expiry_s=self.settings.mqtt.response_expiry_s,
        )
        info = self._client.publish(topic, payload, qos=1, properties=props)
        with self._pubs_lock:
            self._pubs.append(info)
            while self._pubs and self._pubs[0].is_published():
                self._pubs.popleft()

    def _reply_error(
        self,
        device_id: str,
        request_id: str | None,
        code: str,
        message: str,
        correlation: bytes | None = None,
    ) -> None:
        payload, props = encode_error(request_id, code, message)
        self._publish(self.topics.response(device_id, request_id or "_"), payload, props, correlation)

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        """Parse, check, queue; never blocks on Triton."""
        try:
            self._intake(msg)
        except Exception:  # nothing a device sends may take the network thread down
            log.exception("unexpected failure handling a message on %s", msg.topic)
            self._ack(msg.mid, msg.qos)

    def _intake(self, msg: mqtt.MQTTMessage) -> None:
        device = self.topics.device_of_request(msg.topic)
        if device is None:
            log.warning("ignoring a message on %s (not a request topic)", msg.topic)
            self._ack(msg.mid, msg.qos)
            return
        props = received_properties(msg)
        correlation = props.correlation_data
        limits = self.settings.limits
        if len(msg.payload) > limits.max_payload_bytes:
            self._reject(
                msg,
                device,
                peek_request_id(bytes(msg.payload)),
                "too_large",
                f"request of {len(msg.payload)} bytes; the limit is {limits.max_payload_bytes}",
                correlation,
            )
            return
        try:
            request = parse_request(bytes(msg.payload), max_text_chars=limits.max_text_chars)
        except ProtocolError as exc:
            self._reject(msg, device, exc.request_id, exc.code, str(exc), correlation)
            return
        if request.device_id is not None and request.device_id != device:
            self._reject(
                msg,
                device,
                request.id,
                "device_mismatch",
                f"device_id {request.device_id!r} in the request is not the device of its topic ({device!r})",
                correlation,
            )
            return
        now = time.monotonic()
        first_chunk_by = first_chunk_deadline(request, props, now)
        if first_chunk_by is not None and first_chunk_by <= now:
            late_ms = (now - first_chunk_by) * 1e3
            self._reject(
                msg,
                device,
                request.id,
                "expired",
                f"the request's deadline passed {late_ms:.0f} ms before the bridge received it; not synthesized",
                correlation,
            )
            return
        key = (device, request.id)
        verdict = self.admission.offer(key, (self._epoch, msg.mid, msg.qos), redelivery=bool(msg.dup))
        if verdict is Verdict.ACCEPT:
            self.metrics.held.set(self.admission.held)
            self._jobs.put(Job(key, device, request, now, first_chunk_by, bool(msg.dup), correlation))
        elif verdict is Verdict.DUPLICATE_RUNNING:
            self.metrics.duplicates.inc()  # acknowledged with the one that runs
        elif verdict is Verdict.DUPLICATE_DONE:
            self.metrics.duplicates.inc()
            self._ack(msg.mid, msg.qos)
        elif verdict is Verdict.FULL:
            self._reject(
                msg,
                device,
                request.id,
                "busy",
                f"the bridge holds {self.admission.capacity} requests already; try again or serve locally",
                correlation,
            )
        else:
            self._reject(msg, device, request.id, "draining", "the bridge is shutting down", correlation)

    def _reject(
        self,
        msg: mqtt.MQTTMessage,
        device: str,
        request_id: str | None,
        code: str,
        message: str,
        correlation: bytes | None,
    ) -> None:
        log.info("rejected request %s/%s: %s: %s", device, request_id or "_", code, message)
        self.metrics.rejected.labels(code).inc()
        self._reply_error(device, request_id, code, message, correlation)
        self._ack(msg.mid, msg.qos)

    # --- workers -------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._running_lock:
                self._running[job.key] = job
            try:
                self._serve(job)
            finally:
                with self._running_lock:
                    self._running.pop(job.key, None)
                for tag in self.admission.finish(job.key):
                    self._ack_later(tag)
                self.metrics.held.set(self.admission.held)

    def _serve(self, job: Job) -> None:
        req, t = job.request, self.settings.triton
        topic = self.topics.response(job.device_id, req.id)
        version_label = "unknown"
        try:
            if job.first_chunk_by is not None and time.monotonic() >= job.first_chunk_by:
                self.metrics.rejected.labels("expired").inc()
                raise SynthesisFailed(
                    "expired",
                    "the request's deadline passed while it was queued at the bridge; not synthesized",
                )
            choice = self.selector.choose(req.model_version, req.id)
            version_label = choice.version or "default"
            self.metrics.choices.labels(version_label, choice.reason).inc()
            attempts, seq, audio_s = 0, 0, 0.0
            first_at: float | None = None
            times: dict[str, Any] = {}
            # in flight while it streams from Triton, no longer once its answer goes out: a client that reads
            # /metrics after its done message or error finds it 0 (it raced: CI, 2026-12-07)
            with self.metrics.in_flight.track_inprogress():
                while True:
                    attempts += 1
                    try:
                        tag = f"{job.device_id}/{req.id}/{attempts}"
                        for chunk in self.streamer.stream(req, choice.version, tag, job.cancel, job.first_chunk_by):
                            if chunk.model_version:
                                version_label = chunk.model_version
                            payload, props = encode_audio(
                                req.id,
                                chunk.pcm,
                                chunk.sample_rate,
                                seq,
                                chunk.last,
                                chunk.model_version,
                                req.audio_header,
                            )
                            self._publish(topic, payload, props, job.correlation)
                            if first_at is None:
                                first_at = time.monotonic()
                                self.metrics.first_chunk.labels(version_label).observe(first_at - job.received)
                            seq += 1
                            audio_s += chunk.pcm.size / max(1, chunk.sample_rate)
                            times = chunk.times
                        break
                    except SynthesisFailed as exc:
                        if not self._should_retry(exc, job, seq, attempts):
                            raise
                        self.metrics.retries.labels(version_label).inc()
                        delay = t.retry_backoff_ms / 1e3 * 2 ** (attempts - 1)
                        log.info("request %s/%s: %s; retry %d in %.2f s", job.device_id, req.id, exc, attempts, delay)
                        if job.cancel.wait(delay):
                            break
            if job.cancel.is_set():
                raise SynthesisFailed("draining", "the bridge shut down before the request finished")
            done_at = time.monotonic()
            summary = {
                "model": t.model,
                "model_version": version_label,
                "version_reason": choice.reason,
                "chunks": seq,
                "audio_seconds": round(audio_s, 3),
                "first_chunk_ms": None if first_at is None else round((first_at - job.received) * 1e3, 1),
                "total_ms": round((done_at - job.received) * 1e3, 1),
                "attempts": attempts,
                "redelivered": job.redelivered,
                "times": times,
                "bridge": self.settings.mqtt.client_id,
            }
            payload, props = encode_done(req.id, summary)
            # counted before the answer goes out: a client that reads /metrics after its
            # done message must find its request there (it raced under load)
            self.metrics.requests.labels(version_label, "done").inc()
            self.metrics.latency.labels(version_label).observe(done_at - job.received)
            self.metrics.audio_seconds.labels(version_label).inc(audio_s)
            self._publish(topic, payload, props, job.correlation)
            log.info(
                "request %s/%s done: version %s (%s), %d chunks, %.2f s audio, first chunk %s ms, "
                "total %.0f ms, %d attempt(s)",
                job.device_id,
                req.id,
                version_label,
                choice.reason,
                seq,
                audio_s,
                summary["first_chunk_ms"],
                summary["total_ms"],
                attempts,
            )
        except (SynthesisFailed, ProtocolError) as exc:
            self._fail(job, version_label, exc.code, str(exc))
        except Exception as exc:  # a bug here answers this request and keeps the worker alive
            log.exception("request %s/%s failed", job.device_id, req.id)
            self._fail(job, version_label, "model_error", f"bridge failure: {type(exc).__name__}: {exc}")

    def _should_retry(self, exc: SynthesisFailed, job: Job, seq: int, attempts: int) -> bool:
        if not exc.transient or seq > 0 or attempts > self.settings.triton.retries or job.cancel.is_set():
            return False
        delay = self.settings.triton.retry_backoff_ms / 1e3 * 2 ** (attempts - 1)
        return job.first_chunk_by is None or time.monotonic() + delay < job.first_chunk_by

    def _fail(self, job: Job, version_label: str, code: str, message: str) -> None:
        log.info("request %s/%s failed: %s: %s", job.device_id, job.request.id, code, message)
        self.metrics.requests.labels(version_label, code).inc()
        self.metrics.errors.labels(version_label, code).inc()
        self._reply_error(job.device_id, job.request.id, code, message, job.correlation)

    # --- life cycle ----------------------------------------------------------------------------
    def start(self, connect_timeout_s: float | None = None) -> None:
        lim = self.settings.limits
        if self.settings.metrics.port:
            self._metrics_server = self.metrics.serve(self.settings.metrics.port, self.settings.metrics.address)
        for i in range(lim.max_in_flight):
            worker = threading.Thread(target=self._work, name=f"bridge-worker-{i}", daemon=True)
            worker.start()
            self._workers.append(worker)
        connect(self._client, self._mqtt_options(), background=True)
        self._client.loop_start()
        if connect_timeout_s is not None and not self._subscribed.wait(connect_timeout_s):
            log.warning(
                "not subscribed to %s after %.0f s; still trying",
                self.topics.request_filter(),
                connect_timeout_s,
            )

    def wait_subscribed(self, timeout_s: float) -> bool:
        return self._subscribed.wait(timeout_s)

    def stop(self, drain_timeout_s: float | None = None) -> bool:
        """Drain and disconnect; True when every held request finished in time.
        A second call does nothing."""
        if self._stopped:
            return True
        self._stopped = True
        timeout = self.settings.limits.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self.admission.start_draining()
        if self._connected.is_set():
            self._client.unsubscribe(self.topics.shared_request_filter(self.settings.mqtt.share_group))
        clean = self.admission.wait_idle(timeout)
        if not clean:
            log.warning("drain timeout (%.1f s): cancelling %d request(s)", timeout, self.admission.held)
            with self._running_lock:
                for job in self._running.values():
                    job.cancel.set()
            self._cancel_queued()
            self.admission.wait_idle(10.0)
        for _ in self._workers:
            self._jobs.put(None)
        for worker in self._workers:
            worker.join(timeout=10.0)
        self._wait_published(5.0)
        self._client.disconnect()
        self._client.loop_stop()
        self.streamer.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        return clean

    def _cancel_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                continue
            job.cancel.set()
            self._fail(job, "unknown", "draining", "the bridge shut down before the request started")
            for tag in self.admission.finish(job.key):
                self._ack_later(tag)

    def _wait_published(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._pubs_lock:
            pending = list(self._pubs)
        for info in pending:
            left = deadline - time.monotonic()
            if left <= 0 or not self._connected.is_set():
                return
            try:
                info.wait_for_publish(left)
            except (RuntimeError, ValueError):
                return
