"""Broken and hostile Wyoming clients: malformed headers, a payload length
that lies, oversized events, a client gone mid-stream, many idle
connections. Each gets an error event where a reply is possible and its
connection closed; its request is cancelled and freed; the daemon serves
the next client."""

from __future__ import annotations

import socket
import time

from cosyedge_daemon.service.service import Service
from wyoming.tts import Synthesize

from tests.daemon.conftest import DaemonFactory
from tests.support.fake_synthesizer import FakeSynthesizer, GatedSynthesizer
from tests.support.wyoming_client import (
    exchange,
    parse_events,
    raw_frame,
    read_raw_events,
    run,
    tts_port,
)

WY = {"uri": "tcp://127.0.0.1:0", "zeroconf": "off", "read_timeout_s": 0.5, "max_event_bytes": 4096}


def _still_serving(svc: Service) -> None:
    got = run(exchange(tts_port(svc), [Synthesize(text="Still here.").event()], ("audio-stop", "error")))
    assert got[-1].type == "audio-stop", [e.type for e in got]


def _send_raw(svc: Service, data: bytes) -> list[dict]:  # type: ignore[type-arg]
    with socket.create_connection(("127.0.0.1", tts_port(svc))) as s:
        s.sendall(data)
        return read_raw_events(s, timeout_s=5)


def test_broken_frames_get_an_error_and_the_connection_closed(daemons: DaemonFactory) -> None:
    svc = daemons.start(local=FakeSynthesizer(chunks=1), fallback=None, wyoming=WY)
    cases = {
        b"this is not json\n": "invalid_header",
        b"[1, 2]\n": "invalid_header",
        b'{"data": {}}\n': "invalid_header",  # no type
        b'{"type": "synthesize", "data_length": -4}\n': "invalid_header",
        b'{"type": "synthesize", "payload_length": "x"}\n': "invalid_header",
        b'{"type": "synthesize", "payload_length": 99999999}\n': "event_too_large",
        b'{"type": "synthesize", "data_length": 5}\nnot{}': "invalid_data",
        b'{"type": "synthesize", "payload_length": 1000}\n' + b"x" * 10: "truncated",  # lies: never arrives
        b'{"type": "x' + b"a" * 70_000 + b'"}\n': "event_too_large",  # a header line beyond 64 KiB
    }
    for frame, code in cases.items():
        got = _send_raw(svc, frame)
        assert [e["type"] for e in got] == ["error"], (frame[:60], got)
        assert got[0]["data"]["code"] == code, (frame[:60], got)
    assert svc.wyoming is not None and svc.wyoming.tts is not None
    assert svc.wyoming.tts.frame_errors == len(cases)
    _still_serving(svc)


def test_bad_fields_answered_connection_kept(daemons: DaemonFactory) -> None:
    svc = daemons.start(local=FakeSynthesizer(chunks=1), fallback=None, wyoming=WY)
    frames = (raw_frame("synthesize", {"text": 5}) + raw_frame("synthesize-chunk", {"text": "x"})
              + raw_frame("synthesize-stop") + raw_frame("synthesize", {"text": "Fine."}))
    with socket.create_connection(("127.0.0.1", tts_port(svc))) as s:
        s.sendall(frames)
        s.settimeout(10)
        buf = b""
        while "audio-stop" not in [e["type"] for e in parse_events(buf)]:
            part = s.recv(65536)
            assert part
            buf += part
    got = parse_events(buf)
    assert [e["type"] for e in got] == ["error", "error", "error", "audio-start", "audio-chunk", "audio-stop"]
    assert [e["data"]["code"] for e in got[:3]] == ["invalid_field", "invalid_state", "invalid_state"]


def test_text_over_the_limit(daemons: DaemonFactory) -> None:
    svc = daemons.start(local=FakeSynthesizer(chunks=1), fallback=None, wyoming=WY, tts={"max_text_chars": 20})
    got = run(exchange(tts_port(svc), [Synthesize(text="x" * 21).event()], ("error",)))
    assert got[-1].data["code"] == "text_too_long"


def test_disconnect_mid_stream_cancels_and_frees_the_request(daemons: DaemonFactory) -> None:
    engine = GatedSynthesizer(chunks=5)
    svc = daemons.start(local=engine, fallback=None, wyoming=WY)
    with socket.create_connection(("127.0.0.1", tts_port(svc))) as s:
        s.sendall(raw_frame("synthesize", {"text": "Going away."}))
        s.settimeout(10)
        buf = b""
        while b"audio-chunk" not in buf:
            part = s.recv(65536)
            assert part
            buf += part
    assert engine.cancelled.wait(10), "the engine was not told to stop"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (svc.scheduler.running() or svc.wyoming.responder._channels):  # type: ignore[union-attr]
        time.sleep(0.02)
    assert svc.scheduler.running() == []
    assert svc.wyoming is not None and svc.wyoming.responder._channels == {}
    engine.gate.set()
    _still_serving(svc)


def test_many_idle_connections(daemons: DaemonFactory) -> None:
    svc = daemons.start(local=FakeSynthesizer(chunks=1), fallback=None,
                        wyoming={**WY, "max_connections": 4, "idle_timeout_s": 1.5})
    idle = [socket.create_connection(("127.0.0.1", tts_port(svc))) for _ in range(4)]
    try:
        time.sleep(0.2)
        refused = _send_raw(svc, b"")
        assert [e["data"].get("code") for e in refused] == ["busy"]
        for s in idle:  # the idle timeout closes them
            s.settimeout(5)
            assert s.recv(100) == b""
    finally:
        for s in idle:
            s.close()
    _still_serving(svc)
    assert svc.wyoming is not None and svc.wyoming.tts is not None and svc.wyoming.tts.refused == 1
