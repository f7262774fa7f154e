"""Barge-in, sd_notify over a real unix datagram socket, the watchdog only
while workers live, EXTEND_TIMEOUT while an engine loads, /metrics."""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cosyedge_daemon.audio.interfaces import VadEvent
from cosyedge_daemon.service.sdnotify import SdNotifier
from cosyedge_daemon.service.service import Service

from tests.daemon.api.test_daemon_api import LONG
from tests.daemon.conftest import DaemonFactory, make_settings
from tests.support.broker import free_port
from tests.support.memory_sink import MemorySink
from tests.support.waiting import wait_for


class NotifySocket:
    """The receiving end systemd would hold."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[str] = []

    def collect(self, seconds: float) -> list[str]:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with contextlib.suppress(TimeoutError):
                self.messages.append(self.sock.recv(4096).decode())
        return self.messages

    def close(self) -> None:
        self.sock.close()


@pytest.fixture()
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    s = NotifySocket(tmp_path / "notify")
    yield s
    s.close()


def test_sd_notify_protocol(notify_socket: NotifySocket) -> None:
    n = SdNotifier(str(notify_socket.path), watchdog_usec="4000000")
    assert n.watchdog_s == 4.0
    assert n.ready("serving") and n.status("busy") and n.watchdog() and n.extend_timeout(1.5)
    assert notify_socket.collect(0.2) == [
        "READY=1\nSTATUS=serving",
        "STATUS=busy",
        "WATCHDOG=1",
        "EXTEND_TIMEOUT_USEC=1500000",
    ]
    assert not SdNotifier("", watchdog_usec="").enabled and not SdNotifier("").ready()
    assert SdNotifier(str(notify_socket.path), watchdog_usec="100", watchdog_pid="1").watchdog_s is None
    n.close()


def test_abstract_socket_address() -> None:
    name = f"cosyedge-test-{time.monotonic_ns()}"
    recv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    recv.bind("\0" + name)
    recv.settimeout(2)
    try:
        assert SdNotifier("@" + name).ready()
        assert recv.recv(100) == b"READY=1"
    finally:
        recv.close()


def test_extend_timeout_while_loading(notify_socket: NotifySocket) -> None:
    n = SdNotifier(str(notify_socket.path))
    with n.extending("loading", step_s=0.3):
        time.sleep(0.35)
    msgs = notify_socket.collect(0.1)
    assert msgs[0] == "STATUS=loading"
    assert msgs.count("EXTEND_TIMEOUT_USEC=300000") >= 2


def test_service_ready_watchdog_only_while_workers_live(
    daemons: DaemonFactory, notify_socket: NotifySocket
) -> None:
    settings = make_settings(daemons.broker.url)
    svc = Service(settings, notifier=SdNotifier(str(notify_socket.path), watchdog_usec="800000"))
    svc.set_synthesizers(daemons.engine_factory(), None)
    daemons.services.append(svc)
    svc.start(connect_timeout_s=10)
    msgs = notify_socket.collect(0.6)
    assert msgs[0].startswith("READY=1\nSTATUS=ready")
    assert msgs.count("WATCHDOG=1") >= 2
    svc.pipeline.stop(2)  # the synthesis worker is gone
    notify_socket.collect(0.3)
    notify_socket.messages.clear()
    assert "WATCHDOG=1" not in notify_socket.collect(0.8)
    assert svc.health.dead == ["synthesis-1"]
    svc.stop(timeout_s=1)
    assert any(m.startswith("STOPPING=1") for m in notify_socket.collect(0.2))


def test_barge_in_stops_the_playing_request(daemons: DaemonFactory) -> None:
    sink = MemorySink(speed=1.0)
    svc = daemons.start(sink=sink)
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    p.publish(f"{pre}/tts/say", {"id": "talk", "text": LONG})
    assert wait_for(lambda: svc.voice.speaking, 5)  # half-duplex flag for the VAD side
    svc.voice.on_vad_event(VadEvent("speech_start", 3.0))
    done = p.wait_topic(f"{pre}/tts/done/talk", 3).json()
    assert done["reason"] == "interrupted"
    assert p.wait_topic(f"{pre}/vad/event").json()["speaking"] is True
    # stopped before its end: less played than the whole text's audio (asked for once more, published)
    p.publish(f"{pre}/tts/say", {"id": "whole", "text": LONG, "output": "publish"})
    whole = p.wait_topic(f"{pre}/tts/done/whole", 30).json()
    assert sink.played_seconds() < whole["audio_seconds"]


def test_barge_in_ducks_until_speech_ends(daemons: DaemonFactory) -> None:
    sink = MemorySink(speed=2.0)
    svc = daemons.start(sink=sink, vad={"barge_in": "duck", "duck_gain": 0.2})
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    p.publish(f"{pre}/tts/say", {"id": "duck", "text": "A sentence to duck. And one more after it."})
    assert wait_for(lambda: svc.voice.speaking, 5)
    svc.voice.on_vad_event(VadEvent("speech_start", 1.0))
    svc.voice.on_vad_event(VadEvent("speech_end", 1.5, utterance_ms=500))
    assert p.wait_topic(f"{pre}/tts/done/duck").json()["reason"] == "completed"
    assert sink.gains == [0.2, 1.0]


def test_no_barge_in_when_silent(daemons: DaemonFactory) -> None:
    sink = MemorySink(speed=8.0)
    svc = daemons.start(sink=sink)
    svc.voice.on_vad_event(VadEvent("speech_start", 0.5))
    assert sink.flushes == 0 and sink.gains == []


def test_metrics_endpoint(daemons: DaemonFactory) -> None:
    port = free_port()
    svc = daemons.start(health={"metrics_port": port})
    assert svc.metrics_port == port
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    p.publish(f"{pre}/tts/say", {"id": "m1", "text": "Count me.", "output": "publish"})
    p.publish(f"{pre}/tts/say", {"id": "m2", "text": "x", "voice": "nope"})
    p.wait_topic(f"{pre}/tts/done/m1")
    p.wait_topic(f"{pre}/tts/error/m2")
    svc.voice.on_vad_event(VadEvent("speech_start", 0.1))
    time.sleep(0.5)  # one health tick updates the gauges
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'cosyedge_tts_requests_total{outcome="completed",route="local"} 1.0' in body
    assert 'cosyedge_tts_rejected_total{code="unknown_voice"} 1.0' in body
    assert 'cosyedge_tts_first_audio_seconds_count{route="local"} 1.0' in body
    assert 'cosyedge_tts_rtf_count{route="local"} 1.0' in body
    assert "cosyedge_tts_queue_depth 0.0" in body
    assert 'cosyedge_vad_events_total{kind="speech_start"} 1.0' in body
    assert 'cosyedge_engine_state{state="ready",target="local"} 1.0' in body
    assert "cosyedge_mqtt_connected 1.0" in body


def test_trace_logged_as_one_json_line(daemons: DaemonFactory, caplog: pytest.LogCaptureFixture) -> None:
    import json
    import logging

    caplog.set_level(logging.INFO, logger="cosyedge_daemon.trace")
    svc = daemons.start()
    pre = svc.settings.topic_prefix
    p = daemons.probe(svc)
    p.publish(f"{pre}/tts/say", {"id": "tr", "text": "Trace me.", "output": "publish"})
    done = p.wait_topic(f"{pre}/tts/done/tr").json()

    def trace_line() -> dict | None:  # logged right after `done` went out
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "cosyedge_daemon.trace"]
        return next((x for x in lines if x["id"] == "tr"), None)

    deadline = time.monotonic() + 5
    while trace_line() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    line = trace_line()
    assert line is not None
    assert line["event"] == "tts_request" and line["trace"] == done["trace"]


def test_live_settings_and_restart_keys(daemons: DaemonFactory) -> None:
    svc = daemons.start()
    new = make_settings(
        daemons.broker.url,
        device_id=svc.settings.device_id,
        scheduler={"max_queue": 5, "synth_ahead_chunks": 2},
        mqtt={"keepalive_s": 60},
        fallback={"enabled": False},
    )
    restart = svc.apply_settings(new)
    assert svc.scheduler.settings.max_queue == 5
    assert "[scheduler] synth_ahead_chunks" in restart and "[mqtt] keepalive_s" in restart
    assert svc.settings.scheduler.synth_ahead_chunks == 8  # not applied live
    assert svc.synthesizers.slots["fallback"].engine is None
