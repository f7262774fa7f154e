"""Failures on the daemon's side, as an HTTP client sees them: an engine that
fails before any audio (an error status in OpenAI's shape), one that fails
after its audio began (the chunked transfer breaks off), too many requests
at once (429 busy); the daemon serves the next request each time."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx2
import numpy as np
import openai
import pytest
from cosyedge_models.errors import SynthesisError
from cosyedge_models.synthesis.api import AudioChunk, SynthesisRequest

from tests.daemon.conftest import DaemonFactory
from tests.daemon.http.conftest import HTTP, client
from tests.daemon.http.test_http_stream import _wait_seen
from tests.support.fake_synthesizer import FakeSynthesizer


class BreaksMidway(FakeSynthesizer):
    """Its first chunk, then a failure (texts with BREAK); others as FakeSynthesizer."""

    def synthesize(self, request: SynthesisRequest, cancel: threading.Event | None = None) -> Iterator[AudioChunk]:
        if "BREAK" not in request.text:
            yield from super().synthesize(request, cancel)
            return
        yield AudioChunk(np.full(self.chunk_samples, 0.1, np.float32), self.sample_rate, 0, False)
        raise SynthesisError("injected failure after the first chunk")


def speak(svc: object, text: str) -> bytes:
    return client(svc).audio.speech.create(model="cosyedge", voice="alloy", input=text,  # type: ignore[arg-type]
                                           response_format="pcm").content


def test_engine_failure_before_audio_is_an_error_status(daemons: DaemonFactory) -> None:
    svc = daemons.start(local=FakeSynthesizer(chunks=1), fallback=None, http=HTTP)
    with pytest.raises(openai.InternalServerError) as info:
        speak(svc, "FAIL please")
    assert info.value.status_code == 500 and info.value.code == "engine_error"
    assert isinstance(info.value.body, dict) and info.value.body["type"] == "server_error"
    assert speak(svc, "Fine.")


def test_engine_failure_after_audio_breaks_the_transfer(daemons: DaemonFactory) -> None:
    engine = BreaksMidway(chunks=1)
    svc = daemons.start(local=engine, fallback=None, http=HTTP)
    got = b""
    stream = client(svc).audio.speech.with_streaming_response.create(
        model="cosyedge", voice="alloy", input="BREAK now", response_format="pcm")
    with pytest.raises(httpx2.RemoteProtocolError, match="incomplete chunked read"), stream as response:
        assert response.status_code == 200
        for part in response.iter_bytes(chunk_size=None):
            got += part
    assert len(got) == engine.chunk_samples * 2  # the first chunk came, then the transfer broke off
    assert speak(svc, "Fine.")


def test_too_many_requests_is_busy(daemons: DaemonFactory) -> None:
    engine = FakeSynthesizer(chunks=1)
    svc = daemons.start(local=engine, fallback=None, http={**HTTP, "max_connections": 1})
    assert svc.http is not None
    body = json.dumps({"model": "cosyedge", "input": "HOLD first", "voice": "alloy"}).encode()
    with socket.create_connection(("127.0.0.1", svc.http.port)) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert _wait_seen(engine, "HOLD first").entered.wait(20)
        with pytest.raises(openai.RateLimitError) as info:
            speak(svc, "Second.")
        assert info.value.code == "busy"
        engine.release.set()
        sock.settimeout(20)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    assert speak(svc, "Third.")
