"""The HTTP front end of `cosyedge run` (`[http] listen`, `--http-listen`):
an aiohttp application on its own event-loop thread, started and stopped
with the daemon. Routes: `POST /v1/audio/speech` (speech.py; the bearer
token when `[http] api_key` is set), `GET /v1/models`, `GET
/v1/audio/voices` (catalog.py; readable without the token). Every error,
aiohttp's own (unknown path, wrong method, body too large) included, goes
out in OpenAI's error shape (errors.py)."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from cosyedge_daemon.http.admission import HttpAdmission
from cosyedge_daemon.http.catalog import models_list, voices_list
from cosyedge_daemon.http.errors import HttpError, error_body
from cosyedge_daemon.http.speech import SpeechHandler
from cosyedge_daemon.serving.admission import Admission
from cosyedge_daemon.serving.channels import EventLoopThread
from cosyedge_daemon.settings.http import HttpSettings, parse_listen
from cosyedge_daemon.synthesizers.routing import SynthesizerSet
from cosyedge_models.errors import CosyEdgeError

log = logging.getLogger(__name__)
SPEECH_PATH = "/v1/audio/speech"
_AIOHTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def read_api_key(settings: HttpSettings) -> str:
    if settings.api_key_file:
        try:
            return Path(settings.api_key_file).read_text().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            raise CosyEdgeError(f"[http] api_key_file {settings.api_key_file!r} cannot be read: {exc}") from None
    return settings.api_key


def error_response(err: HttpError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return web.Response(status=err.status, body=error_body(err), content_type="application/json", headers=headers)


class HttpFrontend:
    def __init__(self, settings: HttpSettings, admission: Admission, synthesizers: SynthesizerSet) -> None:
        self.settings = settings
        self.host, self.port = parse_listen(settings.listen, "[http] listen")
        self.api_key = read_api_key(settings)
        self.synthesizers = synthesizers
        self.runtime = EventLoopThread("http")
        self.admission = HttpAdmission(admission, settings.priority, settings.max_buffered_audio_s)
        self.speech = SpeechHandler(self.admission, settings.max_connections, settings.write_timeout_s)
        self.errors = 0
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=[self._errors, self._auth])
        app.router.add_post(SPEECH_PATH, self._speech)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/audio/voices", self._voices)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except HttpError as err:
            self.errors += 1
            log.info("HTTP %s %s: %d %s: %s", request.method, request.path, err.status, err.code, err.message)
            return error_response(err)
        except web.HTTPException as exc:  # aiohttp's own: unknown path, wrong method, body too large
            if exc.status < 400:
                raise
            self.errors += 1
            code = _AIOHTTP_CODES.get(exc.status, "invalid_request")
            return error_response(HttpError(code, f"{request.method} {request.path[:120]}: {exc.reason}"))

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.api_key and request.path == SPEECH_PATH:
            got = request.headers.get("Authorization", "")
            scheme, _, token = got.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                raise HttpError("unauthorized", "a valid 'Authorization: Bearer <key>' header is required "
                                "([http] api_key)" if got else "the API key is missing (Authorization: Bearer <key>)")
        return await handler(request)

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        return await self.speech(request)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(models_list(self._created))

    async def _voices(self, request: web.Request) -> web.Response:
        return web.json_response(voices_list(*self.synthesizers.served_voices()))

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self.runtime.start()
        self.runtime.call(self._start())

    async def _start(self) -> None:
        # handler_cancellation: a client that goes away cancels its handler, and so its request,
        # even while the engine has produced nothing to write yet.
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self._runner = runner
        server = site._server  # the bound port, when 0 asked for a free one
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        log.info("HTTP speech API listening on http://%s:%d%s", self.host, self.port, SPEECH_PATH)

    def stop(self) -> None:
        if self.runtime.alive() and self._runner is not None:
            try:
                self.runtime.call(self._runner.cleanup())
            except Exception as exc:
                log.warning("stopping the HTTP listener: %s", exc)
        self.runtime.stop()

    def alive(self) -> bool:
        return self.runtime.alive()

    def describe(self) -> dict[str, Any]:
        """For the health document."""
        c = self.speech.counters
        return {"listen": f"{self.host}:{self.port}", "in_progress": c.in_progress, "served": c.served,
                "refused": c.refused, "cancelled": c.cancelled, "errors": self.errors,
                "api_key": bool(self.api_key)}
