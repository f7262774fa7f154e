"""The HTTP front end's one way into serving: a parsed speech request
becomes the daemon's request through the one builder
(cosyedge_daemon.request.builder) and is admitted by serving's Admission
(duplicates, route, scheduler, trace, metrics) like an MQTT or Wyoming one;
its answers come back on a Channel of the front end's event loop."""

from __future__ import annotations

import asyncio
import logging

from cosyedge_daemon.http.catalog import engine_voice
from cosyedge_daemon.http.errors import HttpError, from_api_error
from cosyedge_daemon.http.request import SpeechRequest
from cosyedge_daemon.request.builder import build_request
from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.serving.admission import Admission
from cosyedge_daemon.serving.channels import Budget, Channel, ChannelResponder, Failed
from cosyedge_daemon.serving.jobs import Job

log = logging.getLogger(__name__)
ID_PREFIX = "http-"


class HttpAdmission:
    def __init__(self, admission: Admission, priority: int, max_buffered_s: float) -> None:
        self.admission = admission
        self.responder = ChannelResponder()
        self.priority = priority
        self.max_buffered_s = max_buffered_s

    async def admit(self, speech: SpeechRequest, received_at: float) -> tuple[Job, Channel]:
        """The admitted job and its channel; HttpError when it is refused."""
        try:
            request = build_request(
                self.admission.limits, speech.input, id_prefix=ID_PREFIX, voice=engine_voice(speech.voice),
                mode="instruct" if speech.instructions else None, instruct_text=speech.instructions,
                output="publish", priority=self.priority, speed=speech.speed, seed=speech.seed,
                # CosyVoice changes the speed on the whole utterance only (as upstream): then the audio
                # comes in one piece at the end instead of streamed.
                stream=speech.speed in (None, 1.0), received_at=received_at,
            )
        except ApiError as exc:
            raise from_api_error(exc.code, exc.message) from None
        # The budget counts PCM16 at the engine's rate, which is known only from the first chunk:
        # bounded at CosyVoice's 24 kHz (a slower engine only gets more seconds).
        channel = Channel(asyncio.get_running_loop(), Budget(int(self.max_buffered_s * 24000 * 2)))
        self.responder.attach(request.id, channel)
        job = self.admission.admit(request, self.responder)
        if job is None:  # refused: its one answer, the error, is on the channel
            answer = await channel.queue.get()
            self.responder.detach(request.id)
            if isinstance(answer, Failed):
                raise from_api_error(answer.code, answer.message)
            raise HttpError("internal", f"request {request.id} was refused without an error")
        return job, channel

    def release(self, job: Job) -> None:
        """The response ended (answered, client gone, server stopping): a job still running is cancelled."""
        if not job.finished:
            log.info("HTTP client of %s gone: cancelling it", job.id)
            self.admission.cancel(job.id)
        self.responder.detach(job.id)
