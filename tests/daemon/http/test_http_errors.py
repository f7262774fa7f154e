"""Bad requests to the HTTP speech API, each answered in OpenAI's error shape
with the daemon's code (as OpenAI's own client reads it), and the daemon
serving the next good request."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import urllib3

from tests.daemon.conftest import DaemonFactory
from tests.daemon.http.conftest import KEY, base_url, client, start


def raw_post(svc: Any, body: bytes, headers: dict[str, str] | None = None, path: str = "/audio/speech",
             method: str = "POST") -> urllib3.BaseHTTPResponse:
    return urllib3.request(method, base_url(svc) + path, body=body, retries=False, timeout=60,
                           headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                                    **(headers or {})})


def still_serving(svc: Any) -> None:
    audio = client(svc).audio.speech.create(model="cosyedge", voice="alloy", input="Still here.",
                                            response_format="pcm")
    assert len(audio.content) > 0


@pytest.mark.parametrize(("kwargs", "status", "code", "param"), [
    ({"input": ""}, 400, "invalid_field", "input"),
    ({"input": "x" * 5000}, 400, "text_too_long", "input"),
    ({"voice": "nobody-here"}, 400, "unknown_voice", "voice"),
    ({"response_format": "aiff"}, 400, "invalid_field", "response_format"),
    ({"model": "gpt-5"}, 400, "unknown_model", "model"),
    ({"speed": 9.0}, 400, "invalid_field", "speed"),
    ({"speed": "fast"}, 400, "invalid_field", "speed"),
    ({"extra_body": {"seed": 2**70}}, 400, "invalid_field", "seed"),
    ({"extra_body": {"loudness": 3}}, 400, "invalid_field", "loudness"),
    ({"stream_format": "sse"}, 400, "invalid_field", "stream_format"),
])
def test_bad_fields_answered_by_code(daemons: DaemonFactory, kwargs: dict[str, Any], status: int, code: str,
                                     param: str | None) -> None:
    svc = start(daemons, api_key=KEY)
    args: dict[str, Any] = {"model": "cosyedge", "voice": "alloy", "input": "Hello.", **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client(svc).audio.speech.create(**args)
    err = info.value
    assert err.status_code == status
    assert err.code == code and err.param == param
    assert isinstance(err.body, dict) and err.body["type"] == "invalid_request_error" and err.body["message"]
    assert "'text'" not in err.body["message"]  # the client's field names, not the daemon's
    still_serving(svc)


def test_token_wrong_or_missing(daemons: DaemonFactory) -> None:
    svc = start(daemons, api_key=KEY)
    with pytest.raises(openai.AuthenticationError) as info:
        client(svc, key="sk-wrong").audio.speech.create(model="cosyedge", voice="alloy", input="Hi.")
    assert info.value.code == "unauthorized"
    body = b'{"model": "cosyedge", "input": "Hi.", "voice": "alloy"}'
    for headers in ({"Authorization": ""}, {"Authorization": "Basic Zm9vOmJhcg=="}):  # missing, another scheme
        reply = raw_post(svc, body, headers)
        assert reply.status == 401 and reply.headers["WWW-Authenticate"] == "Bearer"
        assert reply.json()["error"]["code"] == "unauthorized"
    models = [m.id for m in client(svc, key="sk-wrong").models.list()]  # the listings need no key
    assert "cosyedge" in models
    still_serving(svc)


@pytest.mark.parametrize(("body", "status", "code"), [
    (b"", 400, "invalid_json"),
    (b'{"model": "cosyedge", "input": "Hi.",', 400, "invalid_json"),
    (b'{"model": "cosyedge", "input": "Gr\xfc\xdfe"}', 400, "invalid_utf8"),
    (b'["cosyedge", "Hi."]', 400, "invalid_request"),
    (b'{"model": "cosyedge", "input": "Hi.", "speed": NaN}', 400, "invalid_json"),
    (b'{"model": "cosyedge", "input": "Hi.", "speed": 1e400}', 400, "invalid_field"),
    (b'{"model": "cosyedge", "input": "Hi.", "speed": 1' + b"0" * 400 + b"}", 400, "invalid_field"),
    (b'{"model": "cosyedge", "input": "Hi.", "seed": -1}', 400, "invalid_field"),
    (b'{"model": "cosyedge", "input": 42}', 400, "invalid_field"),
    (b'{"model": "cosyedge", "input": "Hi.", "voice": ["alloy"]}', 400, "invalid_field"),
    (b'{"model": "cosyedge", "input": "Hi.", "speed": true}', 400, "invalid_field"),
    (b'{"input": "Hi."}', 400, "invalid_field"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),  # nested beyond the parser's depth
    (b'{"model": "cosyedge", "input": "' + b"x" * 300_000 + b'"}', 413, "payload_too_large"),
    (b"{" + b'"a":{' * 20_000 + b"}" * 20_001, 400, "invalid_json"),
])
def test_malformed_bodies_answered_by_code(daemons: DaemonFactory, body: bytes, status: int, code: str) -> None:
    svc = start(daemons)
    reply = raw_post(svc, body)
    assert reply.status == status
    error = reply.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]
    still_serving(svc)


def test_unknown_path_and_method(daemons: DaemonFactory) -> None:
    svc = start(daemons)
    reply = raw_post(svc, b"{}", path="/audio/transcriptions")
    assert reply.status == 404 and reply.json()["error"]["code"] == "not_found"
    reply = raw_post(svc, b"", method="GET")
    assert reply.status == 405 and reply.json()["error"]["code"] == "method_not_allowed"
    still_serving(svc)
