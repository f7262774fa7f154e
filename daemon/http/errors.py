"""Errors in the shape OpenAI's clients read, `{"error": {"message", "type",
"param", "code"}}`, carrying the daemon's own codes (docs/mqtt.md lists
them) and the HTTP status each one means. Pure logic: no I/O here."""

from __future__ import annotations

import json
import re

from cosyedge_daemon.request.errors import ApiError

# The daemon's codes and the status an HTTP client gets for each; unlisted: 400.
STATUS = {
    "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "busy": 429,
    "cancelled": 499,
    "internal": 500,
    "engine_error": 500,
    "delivery_failed": 500,
    "synthesizer_unavailable": 503,
    "cloud_unavailable": 503,
    "shutting_down": 503,
    "deadline_exceeded": 504,
}
# The builder names the fields of the daemon's request; an HTTP client knows OpenAI's names.
WIRE_NAMES = {"text": "input", "instruct_text": "instructions"}
CODE_PARAMS = {"unknown_voice": "voice", "text_too_long": "input"}  # codes whose message may not name the field
_FIELD_RE = re.compile(r"^'([a-z_]+)'")


class HttpError(ApiError):
    """An ApiError with the request field it concerns (OpenAI's `param`)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(code, message)
        self.param = param

    @property
    def status(self) -> int:
        return STATUS.get(self.code, 400)


def from_api_error(code: str, message: str) -> HttpError:
    """The daemon's error (builder, admission, engine) in the HTTP client's words."""
    param = CODE_PARAMS.get(code)
    m = _FIELD_RE.match(message)
    if m:
        param = WIRE_NAMES.get(m.group(1), m.group(1))
        message = f"'{param}'{message[m.end():]}"
    return HttpError(code, message, param)


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(err: HttpError) -> bytes:
    return json.dumps({"error": {"message": err.message, "type": error_type(err.status), "param": err.param,
                                 "code": err.code}}).encode()
