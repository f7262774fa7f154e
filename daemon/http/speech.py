"""`POST /v1/audio/speech`: the body parsed (request.py), the request
admitted (admission.py), and its audio encoded (encoders.py) and written
with chunked transfer as the engine produces it. The status and headers go
out with the first audio, so a request refused or failed before any audio
gets a proper error status; one that fails later ends with a broken chunked
stream (the client sees the transfer fail). A client that goes away
cancels its request (the handler is cancelled, or its write fails)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from aiohttp import web
from cosyedge_daemon.http.admission import HttpAdmission
from cosyedge_daemon.http.encoders import CONTENT_TYPES, Encoder, make_encoder
from cosyedge_daemon.http.errors import HttpError, from_api_error
from cosyedge_daemon.http.request import SpeechRequest, parse_speech
from cosyedge_daemon.serving.channels import Audio, Channel, Done, Failed
from cosyedge_daemon.serving.jobs import Job

log = logging.getLogger(__name__)
DEFAULT_RATE = 24000  # CosyVoice 2's; the fallback voice is made at the local synthesizer's rate


@dataclass
class SpeechCounters:
    in_progress: int = 0
    served: int = 0
    refused: int = 0
    cancelled: int = 0


class SpeechHandler:
    def __init__(self, admission: HttpAdmission, max_in_progress: int, write_timeout_s: float) -> None:
        self.admission = admission
        self.max_in_progress = max_in_progress
        self.write_timeout_s = write_timeout_s
        self.counters = SpeechCounters()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        received_at = time.monotonic()
        c = self.counters
        if c.in_progress >= self.max_in_progress:
            c.refused += 1
            raise HttpError("busy", f"too many speech requests in progress ({self.max_in_progress})")
        c.in_progress += 1
        try:
            speech = parse_speech(await request.read())
            job, channel = await self.admission.admit(speech, received_at)
            try:
                return await self._stream(request, speech, job, channel)
            finally:
                if not job.finished:
                    c.cancelled += 1
                self.admission.release(job)
        finally:
            c.in_progress -= 1

    async def _stream(self, request: web.Request, speech: SpeechRequest, job: Job,
                      channel: Channel) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        # Made while the engine works towards its first audio (an mp3 encoder takes milliseconds to set
        # up), at CosyVoice's rate; made again in the rare case the first chunk has another one.
        encoder: Encoder = make_encoder(speech.response_format, DEFAULT_RATE)
        rate = DEFAULT_RATE
        while True:
            item = await channel.queue.get()
            if isinstance(item, Failed):
                if response is None:
                    raise from_api_error(item.code, item.message)
                log.warning("HTTP request %s failed after its audio began: %s: %s", job.id, item.code, item.message)
                if request.transport is not None:
                    request.transport.close()  # a chunked stream without its end: the client sees it failed
                return response
            if response is None:
                first_rate = item.sample_rate if isinstance(item, Audio) else int(item.summary.get("sample_rate")
                                                                                  or DEFAULT_RATE)
                if first_rate != rate:
                    encoder, rate = make_encoder(speech.response_format, first_rate), first_rate
                response = await self._begin(request, speech, job, rate)
            if isinstance(item, Audio):
                step = encoder.slice_bytes or len(item.pcm16)
                for start in range(0, len(item.pcm16), step):
                    data = encoder.encode(item.pcm16[start:start + step])
                    if data and not await self._write(request, response, data):
                        return response  # the client was dropped
                channel.budget.give(len(item.pcm16))
            elif isinstance(item, Done):
                tail = encoder.finish()
                if tail and not await self._write(request, response, tail):
                    return response
                self.counters.served += 1  # before the end goes out: a client holding its answer sees it counted
                await response.write_eof()
                return response

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> bool:
        """Write; or drop a client that takes nothing for write_timeout_s (it would hold its
        connection and a request slot for ever) and return False: the request is then cancelled."""
        try:
            await asyncio.wait_for(response.write(data), self.write_timeout_s)
        except asyncio.TimeoutError:
            log.warning("HTTP client takes no audio for %.1f s; disconnecting it", self.write_timeout_s)
            if request.transport is not None:
                request.transport.abort()
            return False
        return True

    async def _begin(self, request: web.Request, speech: SpeechRequest, job: Job,
                     rate: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={
            "Content-Type": CONTENT_TYPES[speech.response_format],
            "X-Request-Id": job.id,
            "X-Sample-Rate": str(rate),
        })
        response.enable_chunked_encoding()
        await response.prepare(request)
        return response
