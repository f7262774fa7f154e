"""Prometheus metrics of the daemon, in their own registry (so several
daemons in one test process do not collide), served on /metrics."""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)
ENGINE_STATES = ("absent", "loading", "ready", "failed", "unhealthy", "unreachable")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "cosyedge_tts_requests", "finished TTS requests", ["route", "outcome"], registry=r
        )
        self.routes = Counter(
            "cosyedge_tts_routes",
            "finished TTS requests by the route that served them and the rule that chose it",
            ["route", "rule"],
            registry=r,
        )
        self.rejected = Counter(
            "cosyedge_tts_rejected", "requests rejected before queueing, by error code", ["code"], registry=r
        )
        self.latency = Histogram(
            "cosyedge_tts_request_seconds",
            "arrival to done/error",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_audio = Histogram(
            "cosyedge_tts_first_audio_seconds",
            "arrival to first audio out",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queued = Histogram(
            "cosyedge_tts_queued_seconds", "time in the queue", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.rtf = Histogram(
            "cosyedge_tts_rtf", "synthesis time / audio time", ["route"], buckets=_RTF_BUCKETS, registry=r
        )
        self.audio_seconds = Counter(
            "cosyedge_tts_audio_seconds", "seconds of audio produced", ["route"], registry=r
        )
        self.queue_depth = Gauge("cosyedge_tts_queue_depth", "requests waiting", registry=r)
        self.in_flight = Gauge("cosyedge_tts_in_flight", "requests being synthesized or played", registry=r)
        self.active_syntheses = Gauge(
            "cosyedge_tts_active_syntheses",
            "requests on a synthesis worker now (at most [tts] synthesis_workers)",
            registry=r,
        )
        self.synthesis_workers = Gauge(
            "cosyedge_tts_synthesis_workers", "synthesis worker threads ([tts] synthesis_workers)", registry=r
        )
        self.playback_waiting = Gauge(
            "cosyedge_tts_playback_waiting",
            "synthesized-ahead requests waiting for the speaker while an earlier one plays",
            registry=r,
        )
        self.vad_events = Counter("cosyedge_vad_events", "VAD events", ["kind"], registry=r)
        self.barge_ins = Counter(
            "cosyedge_barge_ins", "speech while speaking, by action", ["action"], registry=r
        )
        self.engine_state = Gauge(
            "cosyedge_engine_state",
            "1 for the current state of each engine slot",
            ["target", "state"],
            registry=r,
        )
        self.underruns = Gauge("cosyedge_audio_underruns", "playback underruns since start", registry=r)
        self.mqtt_connected = Gauge("cosyedge_mqtt_connected", "1 while connected to the broker", registry=r)
        self.mqtt_reconnects = Gauge("cosyedge_mqtt_connects", "successful connects since start", registry=r)
        self._server: Any = None
        self._lock = threading.Lock()

    def observe_request(
        self, summary: dict[str, Any] | None, route: str, outcome: str, total_s: float | None
    ) -> None:
        self.requests.labels(route=route, outcome=outcome).inc()
        if total_s is not None:
            self.latency.labels(route=route).observe(total_s)
        if not summary:
            return
        trace = summary.get("trace", {})
        if summary.get("first_audio_ms") is not None:
            self.first_audio.labels(route=route).observe(summary["first_audio_ms"] / 1000.0)
        if trace.get("queued_ms") is not None:
            self.queued.observe(trace["queued_ms"] / 1000.0)
        if summary.get("rtf") is not None:
            self.rtf.labels(route=route).observe(summary["rtf"])
        self.audio_seconds.labels(route=route).inc(summary.get("audio_seconds") or 0.0)

    def set_engine_states(self, states: dict[str, str]) -> None:
        for target, current in states.items():
            for state in ENGINE_STATES:
                self.engine_state.labels(target=target, state=state).set(1.0 if state == current else 0.0)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server; returns the bound port."""
        with self._lock:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
            self._server = server
            bound = int(server.server_address[1])
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._server = None
