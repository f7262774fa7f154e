from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import soundfile
from cosyedge_cloud.wire.protocol import AUDIO_HEADER
from cosyedge_daemon.api.tts_messages import audio_payload, audio_properties, decode_audio, parse_cancel, parse_say
from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.request.request import RequestLimits

LIMITS = RequestLimits(max_payload_bytes=100_000, max_text_chars=500)


def _say(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_full_request() -> None:
    r = parse_say(
        _say(
            {
                "id": "r-1",
                "text": "Hi.",
                "voice": "v",
                "mode": "instruct",
                "instruct_text": "calm",
                "output": "both",
                "route": "local",
                "priority": 5,
                "stream": False,
                "deadline_ms": 800,
                "speed": 1.5,
                "seed": 3,
            }
        ),
        LIMITS,
    )
    assert (r.id, r.text, r.voice, r.mode, r.instruct_text) == ("r-1", "Hi.", "v", "instruct", "calm")
    assert r.client_id  # remembered for the duplicate check
    assert (r.output, r.route, r.priority, r.stream, r.deadline_ms, r.speed, r.seed) == (
        "both",
        "local",
        5,
        False,
        800,
        1.5,
        3,
    )
    sr = r.synthesis_request()
    assert (sr.mode, sr.voice, sr.instruct_text, sr.stream) == ("instruct", "v", "calm", False)
    fb = r.synthesis_request(fallback=True)
    assert (fb.mode, fb.voice, fb.instruct_text) == ("sft", None, None)


def test_defaults_and_generated_id() -> None:
    limits = RequestLimits(default_output="play", default_priority=2, default_deadline_ms=1000)
    a, b = parse_say(_say({"text": "x"}), limits), parse_say(_say({"text": "x"}), limits)
    assert a.id != b.id and len(a.id) == 32
    assert not a.client_id and not b.client_id  # made up here: never resent, not remembered
    assert (a.output, a.priority, a.deadline_ms, a.route, a.mode, a.stream) == (
        "play",
        2,
        1000,
        "auto",
        "sft",
        True,
    )


@pytest.mark.parametrize(
    ("payload", "code", "has_id"),
    [
        (b"", "empty_payload", False),
        (b"{not json", "invalid_json", False),
        (b"\xff\xfe\x00garbage", "invalid_utf8", False),
        (b"[1, 2]", "invalid_request", False),
        (b'"text"', "invalid_request", False),
        (b"[" * 100_000 + b"]" * 100_000, "payload_too_large", False),
        (b"[" * 50_000, "invalid_json", False),
        (_say({"id": "a/b", "text": "x"}), "invalid_id", False),
        (_say({"id": 5, "text": "x"}), "invalid_id", False),
        (_say({"id": "ok1"}), "invalid_field", True),
        (_say({"id": "ok1", "text": 5}), "invalid_field", True),
        (_say({"id": "ok1", "text": "   "}), "invalid_field", True),
        (_say({"id": "ok1", "text": "x" * 501}), "text_too_long", True),
        (_say({"id": "ok1", "text": "x", "mode": "shout"}), "unknown_mode", True),
        (_say({"id": "ok1", "text": "x", "mode": "instruct"}), "invalid_field", True),
        (_say({"id": "ok1", "text": "x", "priority": "high"}), "invalid_field", True),
        (_say({"id": "ok1", "text": "x", "priority": True}), "invalid_field", True),
        (_say({"id": "ok1", "text": "x", "priority": 10**6}), "invalid_field", True),
        (_say({"id": "ok1", "text": "x", "stream": "yes"}), "invalid_field", True),
        (_say({"id": "ok1", "text": "x", "output": "speaker"}), "invalid_field", True),
        (_say({"id": "ok1", "text": "x", "route": "mars"}), "invalid_field", True),
        (_say({"id": "ok1", "text": "x", "deadline_ms": -5}), "invalid_field", True),
        (_say({"id": "ok1", "text": "x", "speed": 9}), "invalid_field", True),
        (_say({"id": "ok1", "text": "x", "colour": "red"}), "invalid_field", True),
        (_say({"id": "ok1", "text": "x", "prompt": "abc"}), "invalid_prompt", True),
        (_say({"id": "ok1", "text": "x", "prompt": {"wav": "!!!"}}), "invalid_prompt", True),
        (
            _say({"id": "ok1", "text": "x", "prompt": {"wav": base64.b64encode(b"nope").decode()}}),
            "invalid_prompt",
            True,
        ),
        (_say({"id": "ok1", "text": "x", "mode": "zero_shot"}), "invalid_field", True),
    ],
)
def test_bad_requests(payload: bytes, code: str, has_id: bool) -> None:
    with pytest.raises(ApiError) as err:
        parse_say(payload, LIMITS)
    assert err.value.code == code
    assert (err.value.request_id == "ok1") is has_id
    assert err.value.message


def test_prompt_audio_decoded() -> None:
    buf = io.BytesIO()
    soundfile.write(buf, np.stack([np.linspace(-0.5, 0.5, 1600)] * 2, axis=1), 16000, format="WAV")
    payload = _say(
        {
            "text": "x",
            "mode": "zero_shot",
            "prompt": {"wav": base64.b64encode(buf.getvalue()).decode(), "text": "ref"},
        }
    )
    r = parse_say(payload, LIMITS)
    assert r.prompt is not None and r.prompt.sample_rate == 16000 and r.prompt.text == "ref"
    assert r.prompt.pcm.shape == (1600,) and abs(float(r.prompt.pcm[-1]) - 0.5) < 1e-3
    long = io.BytesIO()
    soundfile.write(long, np.zeros(16000 * 3), 16000, format="WAV")
    too_long = _say({"id": "p", "text": "x", "prompt": {"wav": base64.b64encode(long.getvalue()).decode()}})
    with pytest.raises(ApiError, match="limit is 2.0 s"):
        parse_say(too_long, RequestLimits(max_prompt_s=2.0))


def test_cancel() -> None:
    assert parse_cancel(b'{"id": "abc"}', 1000) == "abc"
    with pytest.raises(ApiError):
        parse_cancel(b'{"id": 3}', 1000)


def test_audio_header_roundtrip() -> None:
    pcm = np.array([0.0, 0.5, -0.5, 1.2], dtype=np.float32)
    framed = audio_payload(pcm, 24000, 7, True, header=True)
    assert framed[:4] == b"CEA1" and len(framed) == AUDIO_HEADER.size + 8
    d = decode_audio(framed, None)
    assert (d.sample_rate, d.seq, d.last) == (24000, 7, True)
    assert np.frombuffer(d.pcm16, "<i2").tolist() == [0, 16384, -16384, 32767]
    raw = audio_payload(pcm, 24000, 3, False, header=False)
    d2 = decode_audio(raw, audio_properties(24000, 3, False, "x"))
    assert (d2.seq, d2.last, d2.pcm16) == (3, False, raw)
    with pytest.raises(ValueError):
        decode_audio(raw, None)
