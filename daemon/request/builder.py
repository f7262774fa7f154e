"""The one builder of a request: every front end (MQTT `tts/say`, Hermes
`say`, Wyoming `synthesize`) parses its own wire format into plain values and
hands them here, where the defaults are applied and the limits checked, so a
request means the same whichever way it came. What a front end leaves out
(None) gets the configured default. Pure logic: no I/O here."""

from __future__ import annotations

from cosyedge_daemon.mqtt.connection import Reply
from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.request.ids import clip
from cosyedge_daemon.request.request import OUTPUTS, ROUTES, RequestLimits, TtsRequest, new_request_id
from cosyedge_daemon.settings.schema import PRIORITY_MAX, PRIORITY_MIN
from cosyedge_models.synthesis.api import SPEED_MAX, SPEED_MIN, PromptAudio
from cosyedge_models.synthesis.modes import MODES, PROMPT_MODES

SEED_MAX = 2**32 - 1  # the synthesizers seed numpy's generators: 0..2**32-1
MAX_VOICE_CHARS = 128
DEADLINE_MAX_MS = 86_400_000


def _allowed(name: str, value: str, allowed: tuple[str, ...], code: str, rid: str | None) -> None:
    if value not in allowed:
        raise ApiError(code, f"'{name}' is {clip(repr(value))}; allowed: {', '.join(allowed)}", rid)


def build_request(
    limits: RequestLimits,
    text: str,
    *,
    request_id: str | None = None,
    id_prefix: str = "",
    voice: str | None = None,
    mode: str | None = None,
    instruct_text: str | None = None,
    prompt: PromptAudio | None = None,
    output: str | None = None,
    route: str | None = None,
    priority: int | None = None,
    stream: bool | None = None,
    deadline_ms: int | None = None,
    speed: float | None = None,
    seed: int | None = None,
    reply: Reply | None = None,
    received_at: float = 0.0,
) -> TtsRequest:
    """A request with the defaults applied, or ApiError naming the field.
    `request_id`: the client's (remembered for the duplicate check); None: a
    new one (`id_prefix` and 16 hex digits, or 32 hex digits)."""
    rid = request_id
    if not text.strip():
        raise ApiError("invalid_field", "'text' is empty; a non-empty string is required", rid)
    if len(text) > limits.max_text_chars:
        raise ApiError(
            "text_too_long", f"'text' has {len(text)} characters; the limit is {limits.max_text_chars}", rid
        )
    mode = "sft" if mode is None else mode
    _allowed("mode", mode, MODES, "unknown_mode", rid)
    if instruct_text is not None and len(instruct_text) > limits.max_text_chars:
        raise ApiError("text_too_long", "'instruct_text' is too long", rid)
    if mode == "instruct" and not instruct_text:
        raise ApiError("invalid_field", "mode 'instruct' needs 'instruct_text'", rid)
    if priority is not None and not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ApiError("invalid_field", f"'priority' must be between {PRIORITY_MIN} and {PRIORITY_MAX}", rid)
    if deadline_ms is not None and not 0 < deadline_ms <= DEADLINE_MAX_MS:
        raise ApiError("invalid_field", f"'deadline_ms' must be between 1 and {DEADLINE_MAX_MS}", rid)
    if speed is not None and not SPEED_MIN <= speed <= SPEED_MAX:
        raise ApiError("invalid_field", f"'speed' must be between {SPEED_MIN} and {SPEED_MAX}", rid)
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise ApiError("invalid_field", f"'seed' must be between 0 and {SEED_MAX}", rid)
    if voice is not None and len(voice) > MAX_VOICE_CHARS:
        raise ApiError(
            "unknown_voice", f"'voice' has {len(voice)} characters; a voice name has at most {MAX_VOICE_CHARS}", rid
        )
    if prompt is not None and prompt.pcm.shape[0] > limits.max_prompt_s * prompt.sample_rate:
        raise ApiError(
            "invalid_prompt",
            f"'prompt.wav' is {prompt.pcm.shape[0] / prompt.sample_rate:.1f} s; the limit is {limits.max_prompt_s} s",
            rid,
        )
    if mode in PROMPT_MODES and prompt is None and voice is None:
        raise ApiError("invalid_field", f"mode '{mode}' needs a 'prompt' (or a voice with a prompt)", rid)
    output = limits.default_output if output is None else output
    _allowed("output", output, OUTPUTS, "invalid_field", rid)
    route = limits.default_route if route is None else route
    _allowed("route", route, ROUTES, "invalid_field", rid)
    return TtsRequest(
        id=rid or new_request_id(id_prefix),
        client_id=rid is not None,
        text=text,
        voice=voice or limits.default_voice,
        mode=mode,  # type: ignore[arg-type]
        instruct_text=instruct_text,
        prompt=prompt,
        output=output,  # type: ignore[arg-type]
        route=route,  # type: ignore[arg-type]
        priority=limits.default_priority if priority is None else priority,
        stream=True if stream is None else stream,
        deadline_ms=deadline_ms or (limits.default_deadline_ms or None),
        speed=1.0 if speed is None else float(speed),
        seed=seed,
        reply=reply,
        received_at=received_at,
    )
