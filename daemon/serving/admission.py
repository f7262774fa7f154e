"""The one way into serving, for every front end (MQTT and Hermes through
api/intake, Wyoming, HTTP): a built request (cosyedge_daemon.request.builder)
becomes a job that the scheduler queues, with the duplicate check, the audio
device check, the route decided once and preemption; or it is refused. Every
answer of a request handed in here, refusals included, is sent by the
Completer (serving/answer.py), never by the front end itself."""

from __future__ import annotations

import logging
import time

from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.request.request import RequestLimits, TtsRequest, request_limits
from cosyedge_daemon.serving.answer import Completer
from cosyedge_daemon.serving.jobs import Job, Responder
from cosyedge_daemon.serving.pipeline import Pipeline
from cosyedge_daemon.serving.scheduler import DedupeMemory, Scheduler, Terminal
from cosyedge_daemon.settings.schema import Settings

log = logging.getLogger(__name__)


class Admission:
    def __init__(self, settings: Settings, scheduler: Scheduler, pipeline: Pipeline) -> None:
        self.scheduler = scheduler
        self.pipeline = pipeline
        self.router = pipeline.router
        self.completer: Completer = pipeline.completer
        self.has_sink = pipeline.sink is not None
        self.limits: RequestLimits = request_limits(settings, self.has_sink)

    def reconfigure(self, settings: Settings) -> None:
        self.limits = request_limits(settings, self.has_sink)

    def admit(self, request: TtsRequest, responder: Responder) -> Job | None:
        """Queue the request as a job (returned), or refuse it: then its one
        answer (an error, or a duplicate's replay) went to `responder` and
        the result is None."""
        job = Job(request, responder)
        seen = self.scheduler.check_duplicate(request.id) if request.client_id else None
        if seen is not None:
            self._duplicate(job, seen)
            return None
        try:
            if request.output in ("play", "both") and not self.has_sink:
                raise ApiError(
                    "no_audio_device",
                    f"output '{request.output}' needs an audio device; this "
                    "cosyedge_daemon runs without one (use output 'publish')",
                )
            job.decision = self.router.admit(request)
            preempted = self.scheduler.submit(job)
        except ApiError as exc:
            log.info("request %s rejected: %s: %s", request.id, exc.code, exc.message)
            self.completer.refuse(job, exc.code, exc.message)
            return None
        for other in preempted:
            log.info("request %s (priority %d) preempts %s", job.id, job.priority, other.id)
            self.pipeline.stop_job(other, "preempted")
        return job

    def cancel(self, request_id: str) -> None:
        """Cancel a queued or running request (any thread): tts/cancel, a Wyoming client gone."""
        job, was_queued = self.scheduler.cancel(request_id)
        if job is None:
            log.info("cancel of %s: no such request queued or running (ignored)", request_id)
            return
        if was_queued:
            self.completer.stop_queued(job, "cancelled")
        else:
            self.pipeline.stop_job(job, "cancelled")

    def expire(self) -> None:
        """Deadlines (the health tick): a queued request past its deadline is
        answered, a running one without audio by then is stopped."""
        queued, running = self.scheduler.expired()
        for job in queued:
            self.completer.stop_queued(job, "deadline_exceeded")
        for job in running:
            self.pipeline.stop_job(job, "deadline_exceeded")

    def close(self) -> None:
        """Shutdown, first step: refuse new requests (shutting_down) and answer the queued ones."""
        for job in self.scheduler.close():
            self.completer.stop_queued(job, "shutting_down")

    def drain(self, timeout_s: float, stuck_s: float = 3.0) -> None:
        """Shutdown, second step: running requests get `timeout_s` to finish,
        then are stopped (shutting_down); one a stuck synthesizer does not give
        up within `stuck_s` is answered anyway."""
        deadline = time.monotonic() + timeout_s
        while self.scheduler.running() and time.monotonic() < deadline:
            time.sleep(0.02)
        for job in self.scheduler.running():
            self.pipeline.stop_job(job, "shutting_down")
        deadline = time.monotonic() + stuck_s
        while self.scheduler.running() and time.monotonic() < deadline:
            time.sleep(0.02)
        for job in self.scheduler.running():
            self.completer.complete(job)

    def _duplicate(self, job: Job, seen: str | Terminal) -> None:
        """A redelivered (or repeated) id is never spoken again: in flight →
        ignored; finished → the original answer is sent again."""
        if seen == DedupeMemory.PENDING or not isinstance(seen, Terminal):
            log.info("duplicate request %s ignored (still in progress)", job.id)
            return
        log.info("duplicate request %s: replaying its %s", job.id, seen.kind)
        self.completer.replay(job, seen)
