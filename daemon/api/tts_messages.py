"""The native MQTT TTS API: parsing and validating `tts/say` and
`tts/cancel` payloads into typed requests, and encoding what the daemon
sends back (audio chunks, done, error). Pure functions: no I/O here."""

from __future__ import annotations

import base64
import binascii
import io
import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from cosyedge_cloud.wire.protocol import pack_audio_header, pcm16_bytes, unpack_audio_header
from cosyedge_daemon.api.connection import Reply
from cosyedge_daemon.api.request_policy import ID_ALPHABET, clip, leading_id, valid_id
from cosyedge_daemon.service.settings import PRIORITY_MAX, PRIORITY_MIN
from cosyedge_models.synthesis.api import Mode, PromptAudio, SynthesisRequest
from cosyedge_models.synthesis.modes import MODES, PROMPT_MODES

Output = Literal["play", "publish", "both"]
Route = Literal["auto", "local", "cloud"]
OUTPUTS: tuple[Output, ...] = ("play", "publish", "both")
ROUTES: tuple[Route, ...] = ("auto", "local", "cloud")
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
SEED_MAX = 2**32 - 1  # the engines seed numpy's generators: 0..2**32-1
MAX_VOICE_CHARS = 128
_MAX_MESSAGE_CHARS = 400  # an error message never carries more of what a client sent


class ApiError(Exception):
    """A request the daemon answers with an error payload."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        message = clip(message, _MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(frozen=True)
class RequestLimits:
    max_payload_bytes: int = 2_097_152
    max_text_chars: int = 4000
    max_prompt_s: float = 30.0
    default_voice: str | None = None
    default_output: Output = "publish"
    default_route: Route = "auto"
    default_priority: int = 0
    default_deadline_ms: int = 0


@dataclass(frozen=True)
class TtsRequest:
    id: str
    text: str
    voice: str | None = None
    mode: Mode = "sft"
    instruct_text: str | None = None
    prompt: PromptAudio | None = None
    output: Output = "publish"
    route: Route = "auto"
    priority: int = 0
    stream: bool = True
    deadline_ms: int | None = None
    speed: float = 1.0
    seed: int | None = None
    reply: Reply | None = None
    received_at: float = 0.0  # time.monotonic() when the message arrived
    # The client chose the id (and may send it again): only such ids are remembered for the
    # duplicate check. Ids the daemon makes up (no id sent, Wyoming) are never resent, and
    # remembering them would only fill that bounded memory and push the clients' ids out.
    client_id: bool = True

    def synthesis_request(self, *, fallback: bool = False) -> SynthesisRequest:
        """The engine's request; the fallback voice gets the text only (it has
        its own voice and supports plain sft)."""
        if fallback:
            return SynthesisRequest(text=self.text, stream=self.stream, speed=self.speed, seed=self.seed)
        return SynthesisRequest(
            text=self.text,
            mode=self.mode,
            voice=self.voice,
            instruct_text=self.instruct_text,
            prompt=self.prompt,
            stream=self.stream,
            seed=self.seed,
            speed=self.speed,
            priority=self.priority,
        )


def new_request_id() -> str:
    return uuid.uuid4().hex


__all__ = ["valid_id"]  # re-exported: the id policy lives in cosyedge_daemon.api.request_policy


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


def _choice(
    obj: dict[str, Any], name: str, allowed: tuple[str, ...], default: str, code: str, rid: str | None
) -> Any:
    value = _field(obj, name, str, "a string", rid)
    if value is None:
        return default
    if value not in allowed:
        raise ApiError(code, f"'{name}' is {clip(repr(value))}; allowed: {', '.join(allowed)}", rid)
    return value


def parse_prompt(value: Any, max_s: float, rid: str | None) -> PromptAudio:
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
    if pcm.shape[0] > max_s * rate:
        raise ApiError(
            "invalid_prompt", f"'prompt.wav' is {pcm.shape[0] / rate:.1f} s; the limit is {max_s} s", rid
        )
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
    if not isinstance(text, str) or not text.strip():
        what = "missing" if text is None else ("empty" if isinstance(text, str) else "not a string")
        raise ApiError("invalid_field", f"'text' is {what}; a non-empty string is required", rid)
    if len(text) > limits.max_text_chars:
        raise ApiError(
            "text_too_long", f"'text' has {len(text)} characters; the limit is {limits.max_text_chars}", rid
        )
    mode = _choice(obj, "mode", MODES, "sft", "unknown_mode", rid)
    instruct = _field(obj, "instruct_text", str, "a string", rid)
    if instruct is not None and len(instruct) > limits.max_text_chars:
        raise ApiError("text_too_long", "'instruct_text' is too long", rid)
    if mode == "instruct" and not instruct:
        raise ApiError("invalid_field", "mode 'instruct' needs 'instruct_text'", rid)
    priority = _field(obj, "priority", int, "an integer", rid)
    if priority is not None and not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ApiError("invalid_field", f"'priority' must be between {PRIORITY_MIN} and {PRIORITY_MAX}", rid)
    deadline = _field(obj, "deadline_ms", int, "an integer (milliseconds)", rid)
    if deadline is not None and not 0 < deadline <= 86_400_000:
        raise ApiError("invalid_field", "'deadline_ms' must be between 1 and 86400000", rid)
    speed = _field(obj, "speed", (int, float), "a number", rid)
    if speed is not None and not 0.5 <= speed <= 2.0:
        raise ApiError("invalid_field", "'speed' must be between 0.5 and 2.0", rid)
    seed = _field(obj, "seed", int, "an integer", rid)
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise ApiError("invalid_field", f"'seed' must be between 0 and {SEED_MAX}", rid)
    stream = _field(obj, "stream", bool, "true or false", rid)
    voice = _field(obj, "voice", str, "a string", rid)
    if voice is not None and len(voice) > MAX_VOICE_CHARS:
        raise ApiError("unknown_voice", f"'voice' has {len(voice)} characters; a voice name has at most "
                       f"{MAX_VOICE_CHARS}", rid)
    prompt = parse_prompt(obj["prompt"], limits.max_prompt_s, rid) if obj.get("prompt") is not None else None
    if mode in PROMPT_MODES and prompt is None and voice is None:
        raise ApiError("invalid_field", f"mode '{mode}' needs a 'prompt' (or a voice with a prompt)", rid)
    return TtsRequest(
        id=rid or new_request_id(),
        client_id=rid is not None,
        text=text,
        voice=voice or limits.default_voice,
        mode=mode,
        instruct_text=instruct,
        prompt=prompt,
        output=_choice(obj, "output", OUTPUTS, limits.default_output, "invalid_field", rid),
        route=_choice(obj, "route", ROUTES, limits.default_route, "invalid_field", rid),
        priority=limits.default_priority if priority is None else priority,
        stream=True if stream is None else stream,
        deadline_ms=deadline or (limits.default_deadline_ms or None),
        speed=1.0 if speed is None else float(speed),
        seed=seed,
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
    return json.dumps({"id": request_id, "code": code, "message": message}).encode()
