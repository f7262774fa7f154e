"""HTTP speech API overhead benchmark:
`python -m cosyedge_daemon.tools.bench_http --bundle DIR --json FILE`.

A daemon in this process (bench_common: its synthesizer on the bundle)
serves `POST /v1/audio/speech` on loopback; a client measures the time from
sending the request to the first audio byte of the streamed (chunked)
response. The overhead is that minus the engine's own time to first audio
of the same request (its trace line's `engine_first_audio_ms`). Goal: under
5 ms. Clients: Python's own http.client on a kept-alive connection (the
server's path with the least client time; pcm and mp3) and OpenAI's Python
client (`with_streaming_response`, pcm; its own request building counted), taking
turns. For mp3 the first byte is the encoder's first frame. It is measured
twice: on the bundle's engine (whose threads compete with the daemon's for
the cores) and on an instant engine (the path alone)."""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
from cosyedge_daemon.tools.bench_common import GOAL_MS, TraceLines, bench_daemon, latency_stats
from cosyedge_models.tools.host import machine

TEXT = "Hello from the kitchen, the weather is fine today."
FirstByte = Callable[[], float]  # one request: ms from sending it to its first audio byte (all read)


def _raw_client(port: int, fmt: str) -> tuple[FirstByte, Callable[[], None]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"model": "cosyedge", "input": TEXT, "voice": "alloy", "response_format": fmt}).encode()
    headers = {"Content-Type": "application/json"}

    def ask() -> float:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/audio/speech", body, headers)
        response = conn.getresponse()  # the status line and headers go out with the first audio
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        first = response.read1(65536)
        t1 = time.perf_counter()
        if not first:
            raise RuntimeError("no audio")
        response.read()
        return (t1 - t0) * 1000.0

    return ask, conn.close


def _openai_client(port: int) -> tuple[FirstByte, Callable[[], None]]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)

    def ask() -> float:
        t0 = time.perf_counter()
        with client.audio.speech.with_streaming_response.create(
                model="cosyedge", voice="alloy", input=TEXT, response_format="pcm") as response:
            parts = response.iter_bytes(chunk_size=None)
            next(parts)
            t1 = time.perf_counter()
            for _ in parts:
                pass
        return (t1 - t0) * 1000.0

    return ask, client.close


def _runs(clients: dict[str, FirstByte], traces: TraceLines, runs: int, warmup: int) -> dict[str, list[dict[str, Any]]]:
    """The clients take turns, run by run: the machine's other load falls on each alike."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in clients}
    for n in range(warmup + runs):
        for name, ask in clients.items():
            before = len(traces.lines)
            client_ms = ask()
            deadline = time.monotonic() + 5
            while len(traces.lines) == before and time.monotonic() < deadline:
                time.sleep(0.002)
            trace = traces.lines[-1]["trace"]
            engine_ms = trace["engine_first_audio_ms"]
            if n < warmup or engine_ms is None:
                continue
            rows[name].append({"client_first_byte_ms": round(client_ms, 3), "engine_first_audio_ms": engine_ms,
                               "overhead_ms": round(client_ms - engine_ms, 3), "queued_ms": trace["queued_ms"]})
    return rows


def measure(bundle: Path | None, runs: int, warmup: int = 2) -> dict[str, Any]:
    """Overheads on the bundle's engine (None: the instant engine)."""
    results: dict[str, Any] = {}
    with bench_daemon("bench-http", bundle, http={"listen": "127.0.0.1:0"}) as (service, traces, engine):
        assert service.http is not None
        port = service.http.port
        made = {"http.client pcm": _raw_client(port, "pcm"), "http.client mp3": _raw_client(port, "mp3"),
                "openai pcm": _openai_client(port)}
        try:
            all_rows = _runs({name: ask for name, (ask, _) in made.items()}, traces, runs, warmup)
        finally:
            for _, close in made.values():
                close()
        for name, rows in all_rows.items():
            results[name] = {
                "overhead": latency_stats([r["overhead_ms"] for r in rows]),
                "client_first_byte": latency_stats([r["client_first_byte_ms"] for r in rows]),
                "engine_first_audio": latency_stats([r["engine_first_audio_ms"] for r in rows]),
                "runs": rows,
            }
    return {
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),  # other work on the machine meanwhile
        "cpu_count": os.cpu_count(),
        "benchmark": "http_overhead", "machine": machine(), "date": datetime.date.today().isoformat(),
        "bundle": str(bundle) if bundle else None, "engine": engine.name, "text": TEXT, "goal_overhead_ms": GOAL_MS,
        "transport": "loopback TCP, POST /v1/audio/speech, chunked response", "clients": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", required=True)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--json", help="write the raw results here")
    args = p.parse_args(argv)
    report = measure(Path(args.bundle), args.runs)
    report["instant_engine"] = measure(None, args.runs)
    for label, rep in (("engine", report), ("instant", report["instant_engine"])):
        for name, res in rep["clients"].items():
            o = res["overhead"]
            print(f"{label:>8} {name:>16}: overhead median {o['median_ms']} ms, p90 {o['p90_ms']} ms "
                  f"(engine first audio {res['engine_first_audio']['median_ms']} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
