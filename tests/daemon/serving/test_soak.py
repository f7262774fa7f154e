"""Soak: many requests through the real daemon process (espeak-ng engine,
real Mosquitto), a few in flight at a time; every request is answered
exactly once and the daemon's memory levels off (the duplicate-id memory
fills to its bound and stays there). 2,000 requests in the default run
(CI, with the RSS bound), 10,000 in the slow suite, whose figures go to
docs/reliability.md."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import pytest
from cosyedge_daemon.settings.schema import SchedulerSettings

from tests.daemon.service.test_process import Daemon
from tests.support.broker import Broker
from tests.support.daemon_rss import growth_after_warmup, rss_kib, steady_growth
from tests.support.figures import record
from tests.support.mqtt_recorder import Received, Recorder

IN_FLIGHT = 4
DEDUPE_MAX_IDS = SchedulerSettings().dedupe_max_ids
RSS_GROWTH_MAX = 0.05
LAST = "last"


def run_soak(tmp_path: Path, broker: Broker, requests: int, dedupe_max_ids: int = DEDUPE_MAX_IDS) -> dict[str, object]:
    d = Daemon(tmp_path, broker, f"[health]\nmetrics_port = 0\n[scheduler]\ndedupe_max_ids = {dedupe_max_ids}\n")
    answers: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    rss: list[tuple[int, int]] = []

    def on_message(m: Received) -> None:
        rid = m.topic.rsplit("/", 1)[1]
        answers[rid] += 1
        if rid != LAST:
            codes["done" if "/done/" in m.topic else "error"] += 1

    c: Recorder | None = None
    t0 = time.monotonic()
    try:
        d.wait_note("READY=1")
        c = Recorder(broker.url, [f"{d.prefix}/tts/done/+", f"{d.prefix}/tts/error/+"], on_message=on_message,
                     keep=False, name="soak")
        # Warm-up: until the duplicate-id memory is full (it is bounded by
        # [scheduler] dedupe_max_ids) plus a margin; after that the RSS must stay flat.
        warm = min(max(requests // 10, dedupe_max_ids + 500), requests // 2)
        for n in range(requests):
            assert c.wait(lambda n=n: sum(answers.values()) >= n - IN_FLIGHT + 1, 60), f"stalled at {n}"
            c.publish(f"{d.prefix}/tts/say", {"id": f"s{n}", "text": f"Soak {n % 97}.", "output": "publish"})
            if n == warm or n % max(1, requests // 20) == 0:
                rss.append((n, rss_kib(d.proc.pid)))
        c.wait(lambda: sum(answers.values()) >= requests, 60)
        # one request more, answered last: a late or doubled answer would have come before it
        c.publish(f"{d.prefix}/tts/say", {"id": LAST, "text": "Last.", "output": "publish"})
        c.wait(lambda: answers[LAST] > 0, 60)
        rss.append((requests, rss_kib(d.proc.pid)))
        alive = d.proc.poll() is None
    finally:
        if c is not None:
            c.close()
        if d.proc.poll() is None:
            d.proc.terminate()
            d.proc.wait(15)
        d.close()
    missing = [f"s{n}" for n in range(requests) if answers[f"s{n}"] == 0]
    doubled = [rid for rid, k in answers.items() if k > 1 and rid != LAST]
    after_warmup = [kib for n, kib in rss if n >= warm]
    return {"requests": requests, "in_flight": IN_FLIGHT, "answered_once": requests - len(missing) - len(doubled),
            "missing": missing[:20], "doubled": doubled[:20], "outcomes": dict(codes), "daemon_alive": alive,
            "warmup_requests": warm, "rss_kib": rss, "rss_growth_after_warmup": growth_after_warmup(after_warmup),
            "rss_steady_growth": steady_growth(after_warmup),
            "seconds": round(time.monotonic() - t0, 1)}


def check(fig: dict[str, object], requests: int, rss_limit: float | None) -> None:
    assert fig["missing"] == [] and fig["doubled"] == [] and fig["answered_once"] == requests, fig
    assert fig["outcomes"] == {"done": requests} and fig["daemon_alive"], fig
    if rss_limit is not None:
        growth = fig["rss_steady_growth"]  # less a one-off step: tests/support/daemon_rss.py
        assert isinstance(growth, float)
        assert growth < rss_limit, fig["rss_kib"]


CI_REQUESTS = 2000  # the default run (CI): past the warm-up (the duplicate-id memory full) for the RSS bound
CI_DEDUPE_MAX_IDS = 256  # so that the duplicate-id memory is full within the CI run's warm-up


def test_soak_ci(tmp_path: Path, broker: Broker) -> None:
    n = int(os.environ.get("COSYEDGE_SOAK_REQUESTS", CI_REQUESTS))
    fig = run_soak(tmp_path, broker, n, CI_DEDUPE_MAX_IDS)
    print(fig)
    check(fig, n, RSS_GROWTH_MAX)


@pytest.mark.slow
def test_soak_10000(tmp_path: Path, broker: Broker) -> None:
    fig = run_soak(tmp_path, broker, 10_000)
    record("soak", fig)
    check(fig, 10_000, RSS_GROWTH_MAX)
