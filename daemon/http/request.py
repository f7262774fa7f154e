"""OpenAI's speech request (`POST /v1/audio/speech`) from its JSON body:
`model`, `input`, `voice`, `response_format`, `speed`, `instructions` (the
instruct mode), `stream_format` (only `audio`) and the daemon's own `seed`;
any other field is refused. Only the wire is checked here (JSON, UTF-8,
types, names); the limits and defaults are the one builder's
(cosyedge_daemon.request.builder). Pure logic: no I/O here."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from cosyedge_daemon.http.catalog import MODELS
from cosyedge_daemon.http.errors import HttpError
from cosyedge_daemon.request.ids import clip

FORMATS = ("mp3", "opus", "flac", "wav", "pcm")  # OpenAI's, less aac
DEFAULT_FORMAT = "mp3"  # OpenAI's default
STREAM_FORMATS = ("audio",)  # OpenAI's `sse` is not offered
FIELDS = ("model", "input", "voice", "response_format", "speed", "instructions", "stream_format", "seed")


@dataclass(frozen=True)
class SpeechRequest:
    model: str
    input: str
    voice: str | None = None
    response_format: str = DEFAULT_FORMAT
    speed: float | None = None
    instructions: str | None = None
    seed: int | None = None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _decode(body: bytes) -> dict[str, Any]:
    if not body:
        raise HttpError("invalid_json", "the request body is empty; a JSON object is required")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HttpError("invalid_utf8", f"the request body is not UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise HttpError("invalid_json", f"the request body is not JSON: {clip(str(exc))}") from None
    if not isinstance(data, dict):
        raise HttpError("invalid_request", f"the request body must be a JSON object, not {type(data).__name__}")
    return data


def _string(data: dict[str, Any], name: str, required: bool = False) -> str | None:
    value = data.get(name)
    if value is None:
        if required:
            raise HttpError("invalid_field", f"'{name}' is required", name)
        return None
    if not isinstance(value, str):
        raise HttpError("invalid_field", f"'{name}' must be a string, not {clip(value)}", name)
    return value


def _choice(data: dict[str, Any], name: str, allowed: tuple[str, ...], default: str) -> str:
    value = _string(data, name)
    if value is None:
        return default
    if value not in allowed:
        raise HttpError("invalid_field", f"'{name}' is {clip(repr(value))}; allowed: {', '.join(allowed)}", name)
    return value


def _number(data: dict[str, Any], name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HttpError("invalid_field", f"'{name}' must be a number, not {clip(value)}", name)
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        number = math.inf
    if not math.isfinite(number):
        raise HttpError("invalid_field", f"'{name}' is out of range: {clip(value)}", name)
    return number


def parse_speech(body: bytes) -> SpeechRequest:
    """The request, or HttpError naming the field (`param`)."""
    data = _decode(body)
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise HttpError("invalid_field", f"unknown field(s) {clip(', '.join(unknown))}; known: {', '.join(FIELDS)}",
                        unknown[0][:64])
    model = _string(data, "model", required=True)
    if model not in MODELS:
        raise HttpError("unknown_model", f"'model' is {clip(repr(model))}; allowed: {', '.join(MODELS)}", "model")
    text = _string(data, "input", required=True)
    assert text is not None and model is not None
    voice = data.get("voice")
    if isinstance(voice, dict) and set(voice) == {"id"}:  # OpenAI's custom-voice form {"id": "..."}
        voice = voice["id"]
    if voice is not None and not isinstance(voice, str):
        raise HttpError("invalid_field", f"'voice' must be a string, not {clip(voice)}", "voice")
    speed = _number(data, "speed")
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise HttpError("invalid_field", f"'seed' must be an integer, not {clip(seed)}", "seed")
    _choice(data, "stream_format", STREAM_FORMATS, "audio")
    return SpeechRequest(
        model=model,
        input=text,
        voice=voice or None,
        response_format=_choice(data, "response_format", FORMATS, DEFAULT_FORMAT),
        speed=speed,
        instructions=_string(data, "instructions") or None,
        seed=seed,
    )
