"""Property-based fuzzing (hypothesis) of the Wyoming TTS server in the real
daemon process (`python -m cosyedge_daemon run`, espeak-ng engine, real
Mosquitto): sessions of events on one connection each, frames cut at random
byte offsets, every step answered exactly as its oracle
(tests/support/wyoming_fuzz.py) says and nothing more, the daemon online and
serving afterwards, its memory flat. 1,000 sessions in the default run (CI,
with the RSS bound); 10,000 in the slow suite (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from wyoming.event import async_read_event

from tests.daemon.service.test_process import Daemon
from tests.support.broker import Broker
from tests.support.daemon_rss import growth_after_warmup, rss_kib, sample_due, steady_growth
from tests.support.figures import record
from tests.support.fuzz import AnswerCounter
from tests.support.mqtt_recorder import Recorder
from tests.support.wyoming_client import raw_frame as frame
from tests.support.wyoming_fuzz import FRAME_CODES, Session, Step, check_answer, sessions, terminal

MAX_TEXT_CHARS = 120
MAX_EVENT_BYTES = 4096
RSS_GROWTH_MAX = 0.05
STEP_TIMEOUT_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _write(writer: asyncio.StreamWriter, data: bytes, cuts: tuple[int, ...]) -> None:
    """The bytes in pieces cut at `cuts` (relative offsets), each drained: frames split anywhere."""
    at = 0
    for c in cuts:
        if at + c >= len(data):
            break
        writer.write(data[at:at + c])
        await writer.drain()
        at += c
    writer.write(data[at:])
    await writer.drain()


Got = list[tuple[str, dict[str, object]]]


async def _read_until(reader: asyncio.StreamReader, got: Got, done: Callable[[Got], bool]) -> None:
    while not done(got):
        event = await async_read_event(reader)
        if event is None:
            raise ConnectionError(f"the server closed the connection after {[t for t, _ in got]}")
        got.append((event.type, dict(event.data or {})))


async def play(port: int, session: Session, n: int) -> list[str]:
    """Run one session; the oracle's complaints (empty: every step answered exactly)."""
    problems: list[str] = []
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, step in enumerate(session.steps):
            got: list[tuple[str, dict[str, object]]] = []
            await _write(writer, step.frames, session.cuts)
            await asyncio.wait_for(_read_until(reader, got, lambda g, s=step: terminal(s, g)), STEP_TIMEOUT_S)
            mark = f"fz-{n}-{i}"  # then a ping: its pong must be the next event but late answers of the step
            await _write(writer, frame("ping", {"text": mark}), ())
            await asyncio.wait_for(_read_until(
                reader, got, lambda g, m=mark: bool(g) and g[-1][0] == "pong" and g[-1][1].get("text") == m),
                STEP_TIMEOUT_S)
            got.pop()
            if (why := check_answer(step, got)) is not None:
                problems.append(f"step {i} {step.kind} {step.frames[:160]!r}: {why}")
        if session.broken is not None:
            await _write(writer, session.broken, session.cuts)
            got = []
            with contextlib.suppress(ConnectionError):  # the end is expected here
                await asyncio.wait_for(_read_until(reader, got, lambda g: False), STEP_TIMEOUT_S)
            codes = [d.get("code") for t, d in got if t == "error"]
            if len(got) != 1 or codes[0] not in FRAME_CODES:
                problems.append(f"broken frame {session.broken[:120]!r}: expected one framing error, then "
                                f"the end; got {[(t, d.get('code')) for t, d in got]}")
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    return problems


class _WyomingDaemon(Daemon):
    def write(self, mqtt_extra: str, rest: str) -> None:
        super().write(mqtt_extra, rest)
        self.config.write_text(self.config.read_text().replace(
            "[tts]\n", f"[tts]\nmax_text_chars = {MAX_TEXT_CHARS}\n"))


def run_fuzz(tmp_path: Path, broker: Broker, examples: int, warmup: float = 0.1) -> dict[str, object]:
    port = _free_port()
    d = _WyomingDaemon(tmp_path, broker, f'[health]\nmetrics_port = 0\n[wyoming]\nuri = "tcp://127.0.0.1:{port}"\n'
               f'zeroconf = "off"\nmax_event_bytes = {MAX_EVENT_BYTES}\nread_timeout_s = 2.0\n')
    counter = AnswerCounter(())
    status: Recorder | None = None
    stats: Counter[str] = Counter()
    problems: list[str] = []
    rss: list[int] = []
    try:
        d.wait_note("READY=1", 60)
        status = Recorder(broker.url, [f"{d.prefix}/status"], keep=False, name="status",
                          on_message=lambda m: counter.on_message(m.topic, m.payload))

        @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(session=sessions(MAX_TEXT_CHARS, MAX_EVENT_BYTES))
        def one(session: Session) -> None:
            n = stats["sessions"]  # sessions so far (the other counters count steps)
            stats["sessions"] += 1
            for step in session.steps:
                stats[f"step:{step.kind}"] += 1
            stats["broken_frame_last"] += session.broken is not None
            try:
                problems.extend(asyncio.run(play(port, session, n)))
            except (TimeoutError, asyncio.TimeoutError, ConnectionError, OSError) as exc:
                problems.append(f"session {session!r:.2000}: {type(exc).__name__}: {exc}")
            assert len(problems) < 20, problems
            if sample_due(n + 1, examples, warmup):
                rss.append(rss_kib(d.proc.pid))

        one()
        rss.append(rss_kib(d.proc.pid))
        after = asyncio.run(play(port, Session((Step("describe", frame("describe"), answer="info"),), None, ()), -1))
        alive = d.proc.poll() is None
    finally:
        if status is not None:
            status.close()
        if d.proc.poll() is None:
            d.proc.terminate()
            d.proc.wait(15)
        log = d.output()
        d.close()
    return {"examples": stats["sessions"], "by_step": dict(sorted(stats.items())), "problems": problems,
            "serving_afterwards": after == [], "daemon_alive": alive,
            "offline_published_while_running": counter.offline, "rss_kib": rss,
            "rss_growth_after_warmup": growth_after_warmup(rss), "rss_steady_growth": steady_growth(rss),
            "tracebacks": log.count("Traceback"), "internal_errors": len(re.findall(r"handling \S+ failed", log))}


def check(fig: dict[str, object], examples: int, rss_limit: float | None) -> None:
    assert fig["examples"] == examples
    assert fig["problems"] == [], fig["problems"]
    assert fig["serving_afterwards"] and fig["daemon_alive"], fig
    assert fig["offline_published_while_running"] == 0, fig
    assert fig["tracebacks"] == 0 and fig["internal_errors"] == 0, fig
    if rss_limit is not None:
        growth = fig["rss_steady_growth"]  # less a one-off step: tests/support/daemon_rss.py
        assert isinstance(growth, float)
        assert growth < rss_limit, f"RSS grew {growth:.1%} after warm-up, less its largest step: {fig['rss_kib']}"


CI_EXAMPLES = 1000  # the default run (CI): enough after the warm-up for the RSS bound to mean something
# A short run's warm-up is half of it: RSS still settles over the first few hundred sessions (a CI
# run once failed at +6.1 % when the warm-up was counted in steps, not sessions, and so ended early).
CI_WARMUP = 0.5


def test_fuzz_wyoming_sessions_ci(tmp_path: Path, broker: Broker) -> None:
    n = int(os.environ.get("COSYEDGE_FUZZ_EXAMPLES", CI_EXAMPLES))
    t0 = time.monotonic()
    fig = run_fuzz(tmp_path, broker, n, CI_WARMUP)
    print({**fig, "seconds": round(time.monotonic() - t0, 1)})
    check(fig, n, RSS_GROWTH_MAX)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 10,000 examples take 8-20 minutes on two shared cores
def test_fuzz_wyoming_sessions_10000(tmp_path: Path, broker: Broker) -> None:
    fig = run_fuzz(tmp_path, broker, 10_000)
    record("fuzz-wyoming", fig)
    check(fig, 10_000, RSS_GROWTH_MAX)
