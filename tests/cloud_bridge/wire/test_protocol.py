"""The device <-> cloud protocol: topics, request validation, response
encoding both ways (MQTT v5 user properties and the v3.1.1 header)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from cosyedge_cloud.wire.protocol import (
    AUDIO_MAGIC,
    AudioMessage,
    CloudPrompt,
    CloudRequest,
    CloudTopics,
    DoneMessage,
    ErrorMessage,
    ProtocolError,
    decode_response,
    encode_audio,
    encode_done,
    encode_error,
    parse_request,
)


def test_topics_keep_everything_under_the_device_prefix() -> None:
    t = CloudTopics()
    assert t.request("kitchen") == "cosyedge/kitchen/cloud/request"
    assert t.response("kitchen", "r1") == "cosyedge/kitchen/cloud/response/r1"
    assert t.shared_request_filter("g") == "$share/g/cosyedge/+/cloud/request"
    assert t.device_of_request("cosyedge/kitchen/cloud/request") == "kitchen"
    assert t.device_of_request("cosyedge/a/b/cloud/request") is None  # a device id is one level
    assert t.device_of_request("other/kitchen/cloud/request") is None
    assert t.request_of_response("kitchen", "cosyedge/kitchen/cloud/response/r1") == "r1"
    assert t.request_of_response("kitchen", "cosyedge/hall/cloud/response/r1") is None
    with pytest.raises(ValueError, match="wildcards"):
        CloudTopics("a/+")


def test_request_round_trip_with_prompt() -> None:
    pcm = np.sin(np.linspace(0, 20, 1600)).astype(np.float32) * 0.5
    req = CloudRequest(
        id="r-1",
        text="héllo",
        mode="zero_shot",
        voice="v",
        model_version="2",
        deadline_unix_ms=123,
        seed=7,
        prompt=CloudPrompt(pcm, 16000, "transcript"),
        audio_header=True,
        device_id="kitchen",
    )
    back = parse_request(req.to_json())
    assert back.text == "héllo" and back.mode == "zero_shot" and back.model_version == "2"
    assert back.deadline_unix_ms == 123 and back.seed == 7 and back.audio_header and back.device_id == "kitchen"
    assert back.prompt is not None and back.prompt.sample_rate == 16000 and back.prompt.text == "transcript"
    assert np.abs(back.prompt.pcm - pcm).max() < 1e-4


@pytest.mark.parametrize(
    ("payload", "code", "fragment"),
    [
        (b"\xff\xfe", "bad_request", "UTF-8"),
        (b"{not json", "bad_request", "not JSON"),
        (b"[1, 2]", "bad_request", "JSON object"),
        (b'{"text": "hi"}', "bad_request", "'id'"),
        (b'{"id": "a/b", "text": "hi"}', "bad_request", "'id'"),
        (b'{"id": "r", "text": ""}', "bad_request", "'text'"),
        (b'{"id": "r", "text": 5}', "bad_request", "'text' must be a string"),
        (
            b'{"id": "r", "text": "hi", "mode": "sing"}',
            "bad_request",
            "sft, zero_shot, cross_lingual, instruct",
        ),
        (b'{"id": "r", "text": "hi", "mode": "instruct"}', "bad_request", "instruct_text"),
        (b'{"id": "r", "text": "hi", "mode": "zero_shot"}', "bad_request", "prompt"),
        (b'{"id": "r", "text": "hi", "model_version": "latest"}', "bad_request", "model_version"),
        (b'{"id": "r", "text": "hi", "speed": 9}', "bad_request", "speed"),
        (b'{"id": "r", "text": "hi", "stream": 1}', "bad_request", "'stream' must be a boolean"),
        (b'{"id": "r", "text": "hi", "seed": true}', "bad_request", "'seed'"),
        (b'{"id": "r", "text": "hi", "v": 9}', "bad_request", "protocol version"),
        (
            b'{"id": "r", "text": "hi", "prompt": {"audio_b64": "!!", "sample_rate": 16000}}',
            "bad_request",
            "base64",
        ),
    ],
)
def test_bad_requests_name_the_field(payload: bytes, code: str, fragment: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(payload)
    assert info.value.code == code
    assert fragment in str(info.value)


def test_error_keeps_the_request_id_when_it_is_readable() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(b'{"id": "r9", "text": "hi", "mode": "sing"}')
    assert info.value.request_id == "r9"
    with pytest.raises(ProtocolError) as info:
        parse_request(json.dumps({"id": "r9", "text": "x" * 11}).encode(), max_text_chars=10)
    assert info.value.code == "too_large" and info.value.request_id == "r9"


def test_audio_v5_properties_and_v311_header() -> None:
    pcm = np.linspace(-1, 1, 100, dtype=np.float32)
    payload, props = encode_audio("r1", pcm, 24000, 3, True, "2", header=False)
    msg = decode_response(payload, props, "r1")
    assert isinstance(msg, AudioMessage)
    assert (msg.seq, msg.last, msg.sample_rate, msg.model_version) == (3, True, 24000, "2")
    assert np.abs(msg.pcm() - pcm).max() < 1e-4
    # a v3.1.1 receiver gets no properties: the header carries the same facts
    payload, props = encode_audio("r1", pcm, 22050, 4, False, "1", header=True)
    assert payload[:4] == AUDIO_MAGIC
    for user_props in (None, props):
        msg = decode_response(payload, user_props, "r1")
        assert isinstance(msg, AudioMessage)
        assert (msg.seq, msg.last, msg.sample_rate) == (4, False, 22050)
        assert len(msg.pcm16) == 200


def test_done_and_error_decode_without_properties() -> None:
    payload, _ = encode_done("r1", {"chunks": 2})
    done = decode_response(payload, None, "r1")
    assert isinstance(done, DoneMessage) and done.summary["chunks"] == 2
    payload, _ = encode_error("r1", "busy", "full")
    err = decode_response(payload, None, "r1")
    assert isinstance(err, ErrorMessage) and err.code == "busy" and err.retryable
    payload, _ = encode_error(None, "bad_request", "no id")
    err = decode_response(payload, None)
    assert isinstance(err, ErrorMessage) and not err.retryable
    with pytest.raises(ProtocolError):
        decode_response(b"\x00\x01garbage", None)


def test_prompt_pcm_must_be_whole_samples() -> None:
    odd = base64.b64encode(b"\x00\x01\x02").decode()
    doc = {
        "id": "r",
        "text": "hi",
        "mode": "cross_lingual",
        "prompt": {"audio_b64": odd, "sample_rate": 16000},
    }
    with pytest.raises(ProtocolError, match="PCM16"):
        parse_request(json.dumps(doc).encode())
