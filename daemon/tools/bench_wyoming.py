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
import os
import time
from pathlib import Path
from typing import Any

from cosyedge_daemon.tools.bench_common import GOAL_MS, TraceLines, bench_daemon, latency_stats
from cosyedge_daemon.wyoming.client import synthesize
from cosyedge_models.tools.host import machine

TEXT = "Hello from the kitchen, the weather is fine today."


def measure(bundle: Path | None, runs: int, warmup: int = 2) -> dict[str, Any]:
    """Overheads on the bundle's engine (None: the instant engine)."""
    with bench_daemon("bench-wyoming", bundle, wyoming={"uri": "tcp://127.0.0.1:0", "zeroconf": "off"}) as (
            service, traces, engine):
        assert service.wyoming is not None and service.wyoming.tts is not None
        uri = f"tcp://127.0.0.1:{service.wyoming.tts.port}"
        results = _measure(uri, traces, runs, warmup)
    return {
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),  # other work on the machine meanwhile
        "benchmark": "wyoming_overhead", "machine": machine(), "date": datetime.date.today().isoformat(),
        "bundle": str(bundle) if bundle else None, "engine": engine.name, "text": TEXT, "goal_overhead_ms": GOAL_MS,
        "transport": "loopback TCP, wyoming AsyncTcpClient", **results,
    }


def _measure(uri: str, traces: TraceLines, runs: int, warmup: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
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
            "overhead": latency_stats([r["overhead_ms"] for r in rows]),
            "client_first_audio": latency_stats([r["client_first_audio_ms"] for r in rows]),
            "engine_first_audio": latency_stats([r["engine_first_audio_ms"] for r in rows]),
            "runs": rows,
        }
    return results


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
