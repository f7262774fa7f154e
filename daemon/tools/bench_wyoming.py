"""Wyoming overhead benchmark: `python -m cosyedge_daemon.tools.bench_wyoming --bundle DIR --json FILE`.

A daemon in this process (its engine on the bundle, a private mosquitto on
a free loopback port) serves Wyoming on loopback; the `wyoming` package's
client measures the time from `synthesize` (and, streaming, from
`synthesize-stop` of a one-sentence text) to the first `audio-chunk`. The
overhead is that minus the engine's own time to first audio of the same
request (its trace line's `engine_first_audio_ms`). Goal: under 5 ms. It is
measured twice: on the bundle's engine (whose threads compete with the
daemon's for the cores) and on an instant engine (the path alone)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_cloud.wire.broker import ensure_broker
from cosyedge_daemon.service.service import Service
from cosyedge_daemon.settings.loader import parse_broker_url, settings_from_mapping
from cosyedge_daemon.wyoming.client import synthesize
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
from cosyedge_models.tools.host import machine

TEXT = "Hello from the kitchen, the weather is fine today."
GOAL_MS = 5.0


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


class _Traces(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs), 3), "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 3),
            "min_ms": round(xs[0], 3), "max_ms": round(xs[-1], 3)}


def measure(bundle: Path | None, runs: int, warmup: int = 2) -> dict[str, Any]:
    """Overheads on the bundle's engine (None: the instant engine)."""
    port = _free_port()
    settings = settings_from_mapping({
        "device_id": "bench-wyoming", "mqtt": {"broker": f"mqtt://127.0.0.1:{port}"},
        "health": {"metrics_port": 0, "log_traces": True}, "fallback": {"enabled": False},
        "wyoming": {"uri": "tcp://127.0.0.1:0", "zeroconf": "off"},
    })
    try:
        broker = ensure_broker(parse_broker_url(settings.mqtt.broker), "auto")
    except CosyEdgeError as exc:  # no mosquitto (a bare GPU host): Wyoming needs no broker
        print(f"no MQTT broker ({exc}); measuring Wyoming without one")
        broker = None
    traces = _Traces()
    trace_log = logging.getLogger("cosyedge_daemon.trace")
    trace_log.addHandler(traces)
    trace_log.setLevel(logging.INFO)
    service = Service(settings)
    engine: ServedSynthesizer = load_synthesizer(bundle) if bundle is not None else InstantEngine()
    service.set_synthesizers(engine, None)
    service.start(connect_timeout_s=10 if broker is not None else 0.5)
    assert service.wyoming is not None and service.wyoming.tts is not None
    uri = f"tcp://127.0.0.1:{service.wyoming.tts.port}"
    results: dict[str, Any] = {}
    try:
        for mode in ("synthesize", "streaming"):
            rows = []
            for n in range(warmup + runs):
                before = len(traces.lines)
                spoken = asyncio.run(synthesize(uri, TEXT, stream=mode == "streaming"))
                deadline = time.monotonic() + 5
                while len(traces.lines) == before and time.monotonic() < deadline:
                    time.sleep(0.005)
                line = traces.lines[-1]
                engine_ms = line["trace"]["engine_first_audio_ms"]
                if n < warmup or spoken.first_audio_ms is None or engine_ms is None:
                    continue
                rows.append({"client_first_audio_ms": round(spoken.first_audio_ms, 3),
                             "engine_first_audio_ms": engine_ms,
                             "overhead_ms": round(spoken.first_audio_ms - engine_ms, 3),
                             "queued_ms": line["trace"]["queued_ms"]})
            results[mode] = {
                "from": "synthesize" if mode == "synthesize" else "synthesize-stop",
                "overhead": _stats([r["overhead_ms"] for r in rows]),
                "client_first_audio": _stats([r["client_first_audio_ms"] for r in rows]),
                "engine_first_audio": _stats([r["engine_first_audio_ms"] for r in rows]),
                "runs": rows,
            }
    finally:
        service.stop(timeout_s=2)
        trace_log.removeHandler(traces)
        if broker is not None:
            broker.stop()
    return {
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),  # other work on the machine meanwhile
        "benchmark": "wyoming_overhead", "machine": machine(), "date": datetime.date.today().isoformat(),
        "bundle": str(bundle) if bundle else None, "engine": engine.name, "text": TEXT, "goal_overhead_ms": GOAL_MS,
        "transport": "loopback TCP, wyoming AsyncTcpClient", **results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", required=True)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--json", help="write the raw results here")
    args = p.parse_args(argv)
    report = measure(Path(args.bundle), args.runs)
    report["instant_engine"] = measure(None, args.runs)
    for name, rep in (("engine", report), ("instant", report["instant_engine"])):
        for mode in ("synthesize", "streaming"):
            o = rep[mode]["overhead"]
            print(f"{name:>8} {mode:>10} (from {rep[mode]['from']}): overhead median {o['median_ms']} ms, "
                  f"p90 {o['p90_ms']} ms (engine first audio {rep[mode]['engine_first_audio']['median_ms']} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
