"""The native MQTT TTS API: parsing `tts/say` and `tts/cancel` payloads
(JSON, field types; the defaults and limits are the one builder's,
cosyedge_daemon.request.builder) into typed requests, and encoding what the daemon
sends back (audio chunks, done, error). Pure functions: no I/O here."""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from cosyedge_cloud.wire.protocol import pack_audio_header, unpack_audio_header
from cosyedge_daemon.mqtt.connection import Reply
from cosyedge_daemon.request.builder import build_request
from cosyedge_daemon.request.errors import CODE_ALIASES, ApiError
from cosyedge_daemon.request.ids import ID_ALPHABET, clip, leading_id, valid_id
from cosyedge_daemon.request.request import RequestLimits, TtsRequest
from cosyedge_models.pcm import pcm16_bytes
from cosyedge_models.synthesis.api import PromptAudio

NO_ID = "_"  # error topic suffix for requests without a usable id
SAY_FIELDS = (
    "id",
    "text",
    "voice",
    "mode",
    "instruct_text",
    "prompt",
    "output",
    "route",
    "priority",
    "stream",
    "deadline_ms",
    "speed",
    "seed",
)

# v3.1.1 has no user properties, so there (and with audio_header = "always")
# every audio chunk starts with the wire's one audio header (cosyedge_cloud.wire.protocol).


def decode_json_object(payload: bytes, max_bytes: int) -> dict[str, Any]:
    """The payload's JSON object; ApiError otherwise, carrying the id when the
    payload starts with a readable one."""
    if not payload:
        raise ApiError("empty_payload", "the payload is empty; expected a JSON object")
    if len(payload) > max_bytes:
        raise ApiError(
            "payload_too_large",
            f"the payload has {len(payload)} bytes; the limit is {max_bytes}",
            leading_id(payload),
        )
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            "invalid_utf8",
            f"the payload is not valid UTF-8 ({exc.reason} at byte {exc.start})",
            leading_id(payload),
        ) from None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: also integers beyond Python's digit limit
        raise ApiError("invalid_json", f"the payload is not valid JSON: {exc}", leading_id(payload)) from None
    if not isinstance(obj, dict):
        raise ApiError("invalid_request", f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _field(obj: dict[str, Any], name: str, types: type | tuple[type, ...], what: str, rid: str | None) -> Any:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise ApiError("invalid_field", f"'{name}' must be {what}, got {json.dumps(value)[:80]}", rid)
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def parse_prompt(value: Any, rid: str | None) -> PromptAudio:
    if not isinstance(value, dict) or not isinstance(value.get("wav"), str):
        raise ApiError(
            "invalid_prompt", '\'prompt\' must be an object {"wav": base64 WAV, "text": transcript}', rid
        )
    text = value.get("text", "")
    if not isinstance(text, str):
        raise ApiError("invalid_prompt", "'prompt.text' must be a string", rid)
    try:
        wav = base64.b64decode(value["wav"], validate=True)
    except (binascii.Error, ValueError):
        raise ApiError("invalid_prompt", "'prompt.wav' is not valid base64", rid) from None
    import soundfile  # lazily: only voice-cloning requests need it

    try:
        pcm, rate = soundfile.read(io.BytesIO(wav), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        raise ApiError("invalid_prompt", f"'prompt.wav' is not a readable audio file: {exc}", rid) from None
    if pcm.shape[0] == 0:
        raise ApiError("invalid_prompt", "'prompt.wav' has no samples", rid)
    return PromptAudio(
        pcm=np.ascontiguousarray(pcm.mean(axis=1), dtype=np.float32), sample_rate=int(rate), text=text
    )


def parse_say(
    payload: bytes, limits: RequestLimits, *, reply: Reply | None = None, received_at: float = 0.0
) -> TtsRequest:
    """A validated request, or ApiError (with the id when one was usable)."""
    obj = decode_json_object(payload, limits.max_payload_bytes)
    rid: str | None = None
    if "id" in obj and obj["id"] is not None:
        if not valid_id(obj["id"]):
            raise ApiError("invalid_id", f"'id' must be 1-128 characters of {ID_ALPHABET}")
        rid = obj["id"]
    unknown = sorted(set(obj) - set(SAY_FIELDS))
    if unknown:
        names = clip(", ".join(unknown))
        raise ApiError("invalid_field", f"unknown field(s) {names}; known: {', '.join(SAY_FIELDS)}", rid)
    text = obj.get("text")
    if not isinstance(text, str):
        what = "missing" if text is None else "not a string"
        raise ApiError("invalid_field", f"'text' is {what}; a non-empty string is required", rid)
    raw_prompt = obj.get("prompt")
    return build_request(
        limits,
        text,
        request_id=rid,
        voice=_field(obj, "voice", str, "a string", rid),
        mode=_field(obj, "mode", str, "a string", rid),
        instruct_text=_field(obj, "instruct_text", str, "a string", rid),
        prompt=parse_prompt(raw_prompt, rid) if raw_prompt is not None else None,
        output=_field(obj, "output", str, "a string", rid),
        route=_field(obj, "route", str, "a string", rid),
        priority=_field(obj, "priority", int, "an integer", rid),
        stream=_field(obj, "stream", bool, "true or false", rid),
        deadline_ms=_field(obj, "deadline_ms", int, "an integer (milliseconds)", rid),
        speed=_field(obj, "speed", (int, float), "a number", rid),
        seed=_field(obj, "seed", int, "an integer", rid),
        reply=reply,
        received_at=received_at,
    )


def parse_cancel(payload: bytes, max_bytes: int) -> str:
    obj = decode_json_object(payload, max_bytes)
    if not valid_id(obj.get("id")):
        raise ApiError("invalid_id", f'cancel needs {{"id": <id of a request>}}: 1-128 characters of {ID_ALPHABET}')
    return str(obj["id"])


def audio_payload(pcm: np.ndarray, sample_rate: int, seq: int, last: bool, header: bool) -> bytes:
    body = pcm16_bytes(pcm)
    if not header:
        return body
    return pack_audio_header(sample_rate, seq, last) + body


def audio_properties(sample_rate: int, seq: int, last: bool, request_id: str) -> list[tuple[str, str]]:
    return [
        ("sample_rate", str(sample_rate)),
        ("seq", str(seq)),
        ("last", "true" if last else "false"),
        ("id", request_id),
    ]


@dataclass(frozen=True)
class DecodedAudio:
    pcm16: bytes
    sample_rate: int
    seq: int
    last: bool


def decode_audio(payload: bytes, user_properties: list[tuple[str, str]] | None) -> DecodedAudio:
    """For clients: a chunk from either form (header, or v5 user properties)."""
    framed = unpack_audio_header(payload)
    if framed is not None:
        return DecodedAudio(*framed)
    props = dict(user_properties or [])
    if "sample_rate" not in props:
        raise ValueError("audio chunk has neither the CEA1 header nor v5 user properties")
    return DecodedAudio(payload, int(props["sample_rate"]), int(props["seq"]), props["last"] == "true")


def error_payload(request_id: str | None, code: str, message: str) -> bytes:
    doc = {"id": request_id, "code": code, "message": message}
    if code in CODE_ALIASES:  # a renamed code: its old name too, for one release
        doc["alias"] = CODE_ALIASES[code]
    return json.dumps(doc).encode()
