"""The daemon's answer to a request it cannot serve: `ApiError` with a stable
code, whichever front end the request came through (MQTT and Hermes send it
as their error message, Wyoming as an `error` event). The codes and when
each is sent are listed in docs/mqtt.md."""

from __future__ import annotations

from cosyedge_daemon.request.ids import clip

MAX_MESSAGE_CHARS = 400  # an error message never carries more of what a client sent

SYNTHESIZER_UNAVAILABLE = "synthesizer_unavailable"  # no synthesizer can serve the route
# Codes renamed, with their old names: an error with the new code also carries the old one as
# `alias` for one release (docs/mqtt.md), so clients can move over. "engine" names only TensorRT
# plans now.
CODE_ALIASES = {SYNTHESIZER_UNAVAILABLE: "engine_unavailable"}


class ApiError(Exception):
    """A request the daemon answers with an error payload."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
