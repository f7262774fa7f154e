"""What the front-end overhead benchmarks (bench_wyoming, bench_http) share:
a daemon in this process on a bundle's synthesizer or on an instant one
(a private mosquitto on a free loopback port when one can be started), the
trace lines it logs, and the summary of a list of latencies."""

from __future__ import annotations

import json
import logging
import socket
import statistics
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_cloud.wire.broker import ensure_broker
from cosyedge_daemon.service.service import Service
from cosyedge_daemon.settings.loader import parse_broker_url, settings_from_mapping
from cosyedge_models.errors import CosyEdgeError
from cosyedge_models.synthesis.api import (
    AudioChunk,
    Mode,
    ServedSynthesizer,
    StageTimes,
    SynthesisRequest,
    SynthesizerDefaults,
)
from cosyedge_models.synthesis.synthesizer import load_synthesizer

GOAL_MS = 5.0  # a front end's own share of the time to first audio


class InstantEngine(SynthesizerDefaults):
    """An engine whose audio is ready at once (one silent chunk): what is left
    of the time to first audio is the daemon's and the protocol's own path."""

    name = "instant"
    sample_rate = 24000

    def voices(self) -> list[str]:
        return []

    def modes(self) -> tuple[Mode, ...]:
        return ("sft",)

    def validate(self, request: SynthesisRequest) -> None:
        pass

    def synthesize(self, request: SynthesisRequest, cancel: threading.Event | None = None) -> Iterator[AudioChunk]:
        times = StageTimes(first_audio_ms=0.0)
        yield AudioChunk(np.zeros(2400, np.float32), self.sample_rate, 0, True, times)

    def close(self) -> None:
        pass


class TraceLines(logging.Handler):
    """The daemon's trace lines (one JSON object per finished request), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def latency_stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs), 3), "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 3),
            "min_ms": round(xs[0], 3), "max_ms": round(xs[-1], 3)}


@contextmanager
def bench_daemon(device_id: str, bundle: Path | None, **sections: dict[str, Any]) -> Iterator[
        tuple[Service, TraceLines, ServedSynthesizer]]:
    """A started daemon with `sections` of settings, its trace lines and its synthesizer
    (the bundle's, or the instant one for None)."""
    settings = settings_from_mapping({
        "device_id": device_id, "mqtt": {"broker": f"mqtt://127.0.0.1:{free_port()}"},
        "health": {"metrics_port": 0, "log_traces": True}, "fallback": {"enabled": False}, **sections,
    })
    try:
        broker = ensure_broker(parse_broker_url(settings.mqtt.broker), "auto")
    except CosyEdgeError as exc:  # no mosquitto (a bare GPU host): the front ends need no broker
        print(f"no MQTT broker ({exc}); measuring without one")
        broker = None
    traces = TraceLines()
    trace_log = logging.getLogger("cosyedge_daemon.trace")
    trace_log.addHandler(traces)
    trace_log.setLevel(logging.INFO)
    service = Service(settings)
    engine: ServedSynthesizer = load_synthesizer(bundle) if bundle is not None else InstantEngine()
    service.set_synthesizers(engine, None)
    service.start(connect_timeout_s=10 if broker is not None else 0.5)
    try:
        yield service, traces, engine
    finally:
        service.stop(timeout_s=2)
        trace_log.removeHandler(traces)
        if broker is not None:
            broker.stop()
