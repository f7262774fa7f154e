"""MQTT overhead benchmark: time from publishing `tts/say` to the first audio
chunk arriving at a subscriber, minus the engine's own time to first audio
(from `done.trace.engine_first_audio_ms`). That difference is what the
daemon adds (parsing, queueing, routing, publishing, two broker hops); the
goal is under 10 ms on loopback. Runs an in-process daemon against a private
mosquitto (or --broker) with espeak-ng (or --bundle).

    python -m cosyedge_daemon.tools.bench_mqtt [--requests 50] [--bundle DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from typing import Any

from cosyedge_cloud.wire.broker import LocalBroker
from cosyedge_cloud.wire.mqtt import MqttOptions, connect, make_client
from cosyedge_daemon.service.service import Service
from cosyedge_daemon.settings.loader import settings_from_mapping
from cosyedge_daemon.synthesizers.espeak import EspeakSynthesizer


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _probe(broker_url: str, topics: list[str]) -> Any:
    """A minimal subscriber that timestamps arrivals (paho, TCP_NODELAY)."""
    import threading

    opts = MqttOptions(broker=broker_url, client_id=f"bench-{uuid.uuid4().hex[:8]}")
    client = make_client(opts)
    arrivals: dict[str, list[tuple[float, str, bytes]]] = {}
    cond = threading.Condition()
    subscribed = threading.Event()

    def on_message(_c: Any, _u: Any, msg: Any) -> None:
        now = time.perf_counter()
        rid = msg.topic.rsplit("/", 1)[-1]
        kind = msg.topic.split("/")[-2]
        with cond:
            arrivals.setdefault(rid, []).append((now, kind, bytes(msg.payload) if kind != "audio" else b""))
            cond.notify_all()

    client.on_message = on_message
    client.on_connect = lambda c, *_: c.subscribe([(t, 1) for t in topics])
    client.on_subscribe = lambda *_: subscribed.set()
    connect(client, opts)
    client.loop_start()
    subscribed.wait(10)
    return client, arrivals, cond


def bench(broker_url: str, requests: int, bundle: str | None, text: str) -> dict[str, Any]:
    settings = settings_from_mapping(
        {
            "device_id": f"bench{uuid.uuid4().hex[:6]}",
            "mqtt": {"broker": broker_url},
            "health": {"metrics_port": 0, "log_traces": False},
            "scheduler": {"max_wait_ms": 0},
        }
    )
    service = Service(settings)
    if bundle:
        from cosyedge_models.synthesis.synthesizer import load_synthesizer

        local: Any = load_synthesizer(bundle)
    else:
        local = EspeakSynthesizer()
    service.set_synthesizers(local, None)
    service.start(connect_timeout_s=10)
    topics = settings.topics
    client, arrivals, cond = _probe(broker_url, [topics.answers()])
    overhead, first, engine_first = [], [], []
    try:
        for i in range(requests + 3):  # three warm-up requests
            rid = f"b{i}-{uuid.uuid4().hex[:6]}"
            sent = time.perf_counter()
            client.publish(
                topics.say, json.dumps({"id": rid, "text": text, "output": "publish"}), qos=1
            )
            with cond:
                cond.wait_for(
                    lambda rid=rid: any(k in ("done", "error") for _, k, _ in arrivals.get(rid, [])), 60
                )
            events = arrivals.get(rid, [])
            done = next((json.loads(p) for _, k, p in events if k == "done"), None)
            audio = [t for t, k, _ in events if k == "audio"]
            if done is None or not audio or i < 3:
                continue
            eng = done["trace"]["engine_first_audio_ms"] or 0.0
            total = (audio[0] - sent) * 1000.0
            first.append(total)
            engine_first.append(eng)
            overhead.append(total - eng)
    finally:
        client.disconnect()
        client.loop_stop()
        service.stop(timeout_s=2)
    if not overhead:
        raise SystemExit("no request completed")
    return {
        "requests": len(overhead),
        "engine": local.name,
        "text_chars": len(text),
        "overhead_ms": {
            "p50": round(percentile(overhead, 0.5), 3),
            "p95": round(percentile(overhead, 0.95), 3),
            "mean": round(statistics.fmean(overhead), 3),
        },
        "first_audio_ms": {"p50": round(percentile(first, 0.5), 3), "p95": round(percentile(first, 0.95), 3)},
        "engine_first_audio_ms": {"p50": round(percentile(engine_first, 0.5), 3)},
        "goal_overhead_ms": 10.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_daemon.tools.bench_mqtt", description=__doc__.split("\n\n")[0])
    p.add_argument("--broker", help="broker URL (default: a private mosquitto on a free port)")
    p.add_argument("--bundle", help="CosyVoice bundle (default: espeak-ng)")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--text", default="Hello. This is a latency test.")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args(argv)
    broker = None
    url = args.broker
    if url is None:
        broker = LocalBroker(_free_port())
        broker.start()
        url = f"mqtt://127.0.0.1:{broker.port}"
    try:
        result = bench(url, args.requests, args.bundle, args.text)
    finally:
        if broker is not None:
            broker.stop()
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
