"""Soak: many requests through the real daemon process (espeak-ng engine,
real Mosquitto), a few in flight at a time; every request is answered
exactly once and the daemon's memory levels off (the duplicate-id memory
fills to its bound and stays there). 200 requests in the default run,
10,000 in the slow suite, whose figures go to docs/reliability.md."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from cosyedge_daemon.settings.schema import SchedulerSettings
from paho.mqtt.enums import CallbackAPIVersion

from tests.daemon.service.test_process import Daemon
from tests.support.broker import Broker
from tests.support.daemon_rss import growth_after_warmup, rss_kib
from tests.support.figures import record

IN_FLIGHT = 4
DEDUPE_MAX_IDS = SchedulerSettings().dedupe_max_ids
RSS_GROWTH_MAX = 0.05


def run_soak(tmp_path: Path, broker: Broker, requests: int) -> dict[str, object]:
    d = Daemon(tmp_path, broker, "[health]\nmetrics_port = 0\n")
    answers: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    cond = threading.Condition()
    rss: list[tuple[int, int]] = []
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"soak-{uuid.uuid4().hex[:6]}", protocol=mqtt.MQTTv5)

    def on_message(_c: object, _u: object, m: mqtt.MQTTMessage) -> None:
        rid = m.topic.rsplit("/", 1)[1]
        with cond:
            answers[rid] += 1
            codes["done" if "/done/" in m.topic else "error"] += 1
            cond.notify_all()

    subscribed = threading.Event()
    c.on_connect = lambda cl, *_a: cl.subscribe([(f"{d.prefix}/tts/done/+", 1), (f"{d.prefix}/tts/error/+", 1)])
    c.on_subscribe = lambda *_a: subscribed.set()
    c.on_message = on_message
    t0 = time.monotonic()
    try:
        d.wait_note("READY=1")
        c.connect("127.0.0.1", broker.port)
        c.loop_start()
        assert subscribed.wait(10)
        # Warm-up: until the duplicate-id memory is full (it is bounded by
        # [scheduler] dedupe_max_ids) plus a margin; after that the RSS must stay flat.
        warm = min(max(requests // 10, DEDUPE_MAX_IDS + 500), requests // 2)
        for n in range(requests):
            with cond:
                assert cond.wait_for(lambda n=n: sum(answers.values()) >= n - IN_FLIGHT + 1, 60), f"stalled at {n}"
            c.publish(f"{d.prefix}/tts/say", f'{{"id": "s{n}", "text": "Soak {n % 97}.", "output": "publish"}}',
                      qos=1)
            if n == warm or n % max(1, requests // 20) == 0:
                rss.append((n, rss_kib(d.proc.pid)))
        with cond:
            cond.wait_for(lambda: sum(answers.values()) >= requests, 60)
        time.sleep(1.0)
        rss.append((requests, rss_kib(d.proc.pid)))
        alive = d.proc.poll() is None
    finally:
        c.disconnect()
        c.loop_stop()
        if d.proc.poll() is None:
            d.proc.terminate()
            d.proc.wait(15)
        d.close()
    missing = [f"s{n}" for n in range(requests) if answers[f"s{n}"] == 0]
    doubled = [rid for rid, k in answers.items() if k > 1]
    after_warmup = [kib for n, kib in rss if n >= warm]
    return {"requests": requests, "in_flight": IN_FLIGHT, "answered_once": requests - len(missing) - len(doubled),
            "missing": missing[:20], "doubled": doubled[:20], "outcomes": dict(codes), "daemon_alive": alive,
            "warmup_requests": warm, "rss_kib": rss, "rss_growth_after_warmup": growth_after_warmup(after_warmup),
            "seconds": round(time.monotonic() - t0, 1)}


def check(fig: dict[str, object], requests: int, rss_limit: float | None) -> None:
    assert fig["missing"] == [] and fig["doubled"] == [] and fig["answered_once"] == requests, fig
    assert fig["outcomes"] == {"done": requests} and fig["daemon_alive"], fig
    if rss_limit is not None:
        assert isinstance(fig["rss_growth_after_warmup"], float)
        assert fig["rss_growth_after_warmup"] < rss_limit, fig["rss_kib"]


def test_soak_short(tmp_path: Path, broker: Broker) -> None:
    n = int(os.environ.get("COSYEDGE_SOAK_REQUESTS", 200))
    check(run_soak(tmp_path, broker, n), n, None)


@pytest.mark.slow
def test_soak_10000(tmp_path: Path, broker: Broker) -> None:
    fig = run_soak(tmp_path, broker, 10_000)
    record("soak", fig)
    check(fig, 10_000, RSS_GROWTH_MAX)
