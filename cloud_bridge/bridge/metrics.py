"""Prometheus metrics of the bridge, labelled by the model version that
served (so a canary's error rate and latency can be compared with the
default's), on their own registry.

Error rate of a version, in PromQL:
    rate(cosyedge_bridge_errors_total{version="2"}[5m])
      / rate(cosyedge_bridge_requests_total{version="2"}[5m])
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (
    0.025,
    0.05,
    0.1,
    0.2,
    0.35,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    8.0,
    13.0,
    21.0,
    34.0,
    60.0,
    120.0,
)


class BridgeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "cosyedge_bridge_requests",
            "requests finished, by served model version and outcome (done or an error code)",
            ["version", "outcome"],
            registry=r,
        )
        self.errors = Counter(
            "cosyedge_bridge_errors",
            "requests that ended in an error, by model version and code",
            ["version", "code"],
            registry=r,
        )
        self.rejected = Counter(
            "cosyedge_bridge_rejected",
            "requests answered without synthesis, by reason",
            ["reason"],
            registry=r,
        )
        self.retries = Counter(
            "cosyedge_bridge_retries", "Triton calls retried after a transient error", ["version"], registry=r
        )
        self.duplicates = Counter(
            "cosyedge_bridge_duplicates",
            "QoS 1 redeliveries of requests already held or answered",
            registry=r,
        )
        self.latency = Histogram(
            "cosyedge_bridge_request_seconds",
            "request received to done",
            ["version"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_chunk = Histogram(
            "cosyedge_bridge_first_chunk_seconds",
            "request received to first audio chunk published",
            ["version"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.audio_seconds = Counter("cosyedge_bridge_audio_seconds", "audio published", ["version"], registry=r)
        self.in_flight = Gauge("cosyedge_bridge_in_flight", "requests streaming from Triton", registry=r)
        self.held = Gauge(
            "cosyedge_bridge_held", "requests accepted and not yet answered (in flight + queued)", registry=r
        )
        self.choices = Counter(
            "cosyedge_bridge_version_choices",
            "version choices, by requested version and reason (pinned, canary, default)",
            ["version", "reason"],
            registry=r,
        )
        self.connected = Gauge("cosyedge_bridge_mqtt_connected", "1 while connected to the broker", registry=r)

    def serve(self, port: int, address: str) -> Any:
        """Start the /metrics endpoint; returns the server (shutdown() stops it)."""
        server, _thread = start_http_server(port, addr=address, registry=self.registry)
        return server

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (tests, the health log line); 0 if absent."""
        got = self.registry.get_sample_value(name, labels)
        return 0.0 if got is None else float(got)
