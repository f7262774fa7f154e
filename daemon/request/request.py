"""The daemon's one request type, whichever front end it came through
(MQTT `tts/say`, Hermes `say`, Wyoming `synthesize`), and the limits and
defaults every front end applies through the one builder
(`cosyedge_daemon.request.builder`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from cosyedge_cloud.wire.protocol import MAX_REQUEST_BYTES
from cosyedge_daemon.mqtt.connection import Reply
from cosyedge_daemon.settings.schema import Settings
from cosyedge_models.synthesis.api import MAX_TEXT_CHARS, Mode, PromptAudio, SynthesisRequest

Output = Literal["play", "publish", "both"]
Route = Literal["auto", "local", "cloud"]
OUTPUTS: tuple[Output, ...] = ("play", "publish", "both")
ROUTES: tuple[Route, ...] = ("auto", "local", "cloud")


@dataclass(frozen=True)
class RequestLimits:
    """What every front end's requests are held to, and their defaults: made
    from the settings by `request_limits` (the one source)."""

    max_payload_bytes: int = MAX_REQUEST_BYTES
    max_text_chars: int = MAX_TEXT_CHARS
    max_prompt_s: float = 30.0
    default_voice: str | None = None
    default_output: Output = "publish"
    default_route: Route = "auto"
    default_priority: int = 0
    default_deadline_ms: int = 0


def request_limits(settings: Settings, has_sink: bool) -> RequestLimits:
    t, s = settings.tts, settings.scheduler
    output = t.default_output if t.default_output != "auto" else ("play" if has_sink else "publish")
    return RequestLimits(
        max_payload_bytes=settings.mqtt.max_payload_bytes,
        max_text_chars=t.max_text_chars,
        max_prompt_s=t.max_prompt_s,
        default_voice=t.default_voice or None,
        default_output=output,  # type: ignore[arg-type]
        default_route=settings.routing.default_route,  # type: ignore[arg-type]
        default_priority=s.default_priority,
        default_deadline_ms=s.default_deadline_ms,
    )


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


def new_request_id(prefix: str = "") -> str:
    """An id for a request that brought none: 32 hex digits, or `prefix` and 16."""
    return f"{prefix}{uuid.uuid4().hex[:16]}" if prefix else uuid.uuid4().hex
