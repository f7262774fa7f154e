"""What the API lists without a key: `GET /v1/models` (the model names a
speech request may give) and `GET /v1/audio/voices` (the engine's voices
and the OpenAI voice names that mean its default voice). Pure logic."""

from __future__ import annotations

from typing import Any

MODEL = "cosyedge"
# OpenAI's speech model names, accepted so that clients with a fixed model name work: all mean
# the daemon's one local engine (the route is the daemon's own choice, as for every front end).
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
MODELS = (MODEL, *OPENAI_MODELS)
# OpenAI's voice names: a client offers them by default; each means the default voice.
OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")
DEFAULT_VOICE = "default"


def engine_voice(name: str | None) -> str | None:
    """The engine voice a request's `voice` means: None (the default) for an
    OpenAI name or `default`; any other name as is (the engine's own check
    answers an unknown one with unknown_voice)."""
    if name is None or name == DEFAULT_VOICE or name in OPENAI_VOICES:
        return None
    return name


def models_list(created: int) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": m, "object": "model", "created": created, "owned_by": "cosyedge"} for m in MODELS
    ]}


def voices_list(engine: str, voices: list[str]) -> dict[str, Any]:
    return {
        "engine": engine,
        "voices": [{"id": v, "name": v} for v in (voices or [DEFAULT_VOICE])],
        "aliases": {v: "default" for v in OPENAI_VOICES},
    }
