"""Streaming: the audio goes out as the engine produces it (chunked), a
streamed read carries the same audio as a whole one, and a client that goes
away cancels its request (seen by the engine's cancel event and the trace,
not by timing) while the daemon serves on."""

from __future__ import annotations

import json
import logging
import socket

import numpy as np
import pytest

from tests.daemon.conftest import DaemonFactory
from tests.daemon.http.conftest import HTTP, client, start
from tests.daemon.http.test_http_speech import SEED, TEXT, pcm16
from tests.support.fake_synthesizer import FakeSynthesizer, GatedSynthesizer, Seen
from tests.support.waiting import wait_for, wait_until


def test_audio_is_streamed_as_produced(daemons: DaemonFactory) -> None:
    engine = GatedSynthesizer(chunks=3)
    svc = daemons.start(local=engine, fallback=None, http=HTTP)
    with client(svc).audio.speech.with_streaming_response.create(
            model="cosyedge", voice="alloy", input="Hello there.", response_format="pcm") as response:
        assert response.headers["transfer-encoding"] == "chunked"
        parts = response.iter_bytes(chunk_size=None)
        first = next(parts)  # the engine holds its other chunks until the gate opens: streamed
        assert not engine.gate.is_set() and 0 < len(first) <= engine.chunk_samples * 2
        engine.gate.set()
        body = first + b"".join(parts)
    assert np.allclose(pcm16(body), 0.1, atol=1e-3) and len(body) == 3 * engine.chunk_samples * 2


def test_streamed_read_equals_the_whole_one(daemons: DaemonFactory) -> None:
    svc = start(daemons)
    c = client(svc)
    whole = c.audio.speech.create(model="cosyedge", voice="alloy", input=TEXT, response_format="pcm",
                                  extra_body=SEED).content
    with c.audio.speech.with_streaming_response.create(model="cosyedge", voice="alloy", input=TEXT,
                                                       response_format="pcm", extra_body=SEED) as response:
        pieces = list(response.iter_bytes(chunk_size=None))
    assert len(pieces) >= 2 and b"".join(pieces) == whole


def _trace(caplog: pytest.LogCaptureFixture, outcome: str) -> dict[str, object]:
    """The trace line of the first HTTP request that ended with `outcome`."""
    def found() -> list[dict[str, object]]:
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "cosyedge_daemon.trace"]
        return [x for x in lines if str(x["id"]).startswith("http-") and x["outcome"] == outcome]

    assert wait_for(found, 20), f"no HTTP request ended {outcome}"
    return found()[0]


def test_client_gone_mid_stream_cancels(daemons: DaemonFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cosyedge_daemon.trace")
    engine = GatedSynthesizer(chunks=3)
    svc = daemons.start(local=engine, fallback=None, http=HTTP)
    with client(svc).audio.speech.with_streaming_response.create(
            model="cosyedge", voice="alloy", input="Going away.", response_format="wav") as response:
        assert next(response.iter_bytes(chunk_size=None))
    # The client closed the connection after the first chunk: the engine is told to stop.
    assert engine.cancelled.wait(20)
    assert _trace(caplog, "cancelled")["route"] == "local"
    engine.gate.set()
    assert len(client(svc).audio.speech.create(model="cosyedge", voice="alloy", input="Next.",
                                               response_format="pcm").content) == 3 * engine.chunk_samples * 2
    assert svc.http is not None
    wait_until(lambda: svc.http.describe()["cancelled"] == 1)  # type: ignore[union-attr]


def test_client_gone_before_any_audio_cancels(daemons: DaemonFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cosyedge_daemon.trace")
    engine = FakeSynthesizer(chunks=2)
    svc = daemons.start(local=engine, fallback=None, http=HTTP)
    assert svc.http is not None
    body = json.dumps({"model": "cosyedge", "input": "HOLD quiet", "voice": "alloy"}).encode()
    with socket.create_connection(("127.0.0.1", svc.http.port)) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = _wait_seen(engine, "HOLD quiet")
        assert seen.entered.wait(20)
    # Nothing was written yet: only the closed connection tells the server, which cancels the handler.
    assert _trace(caplog, "cancelled")["route"] == "local"
    assert seen.left.wait(20) and seen.cancelled
    engine.release.set()
    assert client(svc).audio.speech.create(model="cosyedge", voice="alloy", input="After.",
                                           response_format="pcm").content


def _wait_seen(engine: FakeSynthesizer, text: str) -> Seen:
    assert wait_for(lambda: text in engine.seen, 20), f"the engine never started {text!r}"
    return engine.seen[text]


def test_client_that_reads_nothing_is_dropped(daemons: DaemonFactory, caplog: pytest.LogCaptureFixture) -> None:
    """A client that sends its request and never reads: its request is cancelled once
    max_buffered_audio_s waits for it, and its connection dropped after write_timeout_s
    instead of holding a request slot for ever; the daemon serves on."""
    caplog.set_level(logging.INFO, logger="cosyedge_daemon.trace")
    engine = FakeSynthesizer(chunks=400, chunk_s=1.0)  # 400 s of audio: far more than the socket buffers hold
    # 200 s of audio waiting (9.6 MB) is more than the socket buffers take: the server's writes block first.
    svc = daemons.start(local=engine, fallback=None,
                        http={**HTTP, "write_timeout_s": 0.5, "max_buffered_audio_s": 200})
    assert svc.http is not None
    body = json.dumps({"model": "cosyedge", "input": "Long story.", "voice": "alloy",
                       "response_format": "pcm"}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.connect(("127.0.0.1", svc.http.port))
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert _trace(caplog, "cancelled")["route"] == "local"
        assert engine.seen["Long story."].left.wait(20) and engine.seen["Long story."].produced < 400
        wait_until(lambda: svc.http.describe()["in_progress"] == 0, 20)  # type: ignore[union-attr]
        assert svc.http.describe()["served"] == 0
    engine.chunks = 1  # a short answer the client reads
    assert client(svc).audio.speech.create(model="cosyedge", voice="alloy", input="Next.",
                                           response_format="pcm").content
