"""The one owner of every answer to a request handed to serving
(serving/admission.py): an accepted job ends exactly once, `done` or `error`
to its responder, with the duplicate-id memory, metrics and the one-line
JSON trace in the log (`complete`, `stop_queued`); a refused one gets its
error (`refuse`), a duplicate its first answer again (`replay`). The
synthesis workers, the playback worker, the deadline and cancel paths and
the drain at shutdown all answer through here."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from cosyedge_daemon.serving.jobs import ERROR_STOPS, Job
from cosyedge_daemon.serving.metrics import Metrics
from cosyedge_daemon.serving.scheduler import Scheduler, Terminal

log = logging.getLogger(__name__)
trace_log = logging.getLogger("cosyedge_daemon.trace")

STOP_MESSAGES = {
    "cancelled": "cancelled by request",
    "deadline_exceeded": "the deadline passed before the first audio",
    "shutting_down": "the daemon is shutting down",
}


class Completer:
    def __init__(self, scheduler: Scheduler, metrics: Metrics | None, log_traces: bool = True) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.log_traces = log_traces

    def refuse(self, job: Job, code: str, message: str) -> None:
        """The error of a request that was not accepted (never queued)."""
        if self.metrics is not None:
            self.metrics.rejected.labels(code=code).inc()
        if not job.claim_terminal():
            return
        try:
            job.responder.error(job, code, message)
        except Exception:
            log.exception("answering request %s failed", job.id)

    def replay(self, job: Job, terminal: Terminal) -> None:
        """A duplicate of a finished request: its first answer again."""
        if not job.claim_terminal():
            return
        try:
            if terminal.kind == "done":
                job.responder.done(job, terminal.payload)
            else:
                job.responder.error(job, str(terminal.payload["code"]), str(terminal.payload["message"]))
        except Exception:
            log.exception("answering duplicate request %s failed", job.id)

    def stop_queued(self, job: Job, reason: str) -> None:
        """End a job the scheduler has already given up (cancelled, past its
        deadline or still queued at shutdown) with the reason's answer."""
        job.stop(reason)
        self.complete(job)

    def complete(self, job: Job, error: tuple[str, str] | None = None) -> None:
        """Send the job's terminal answer (once; later calls do nothing)."""
        if not job.claim_terminal():
            return
        now = time.monotonic()
        if error is None and job.stop_reason in ERROR_STOPS:
            error = (job.stop_reason, STOP_MESSAGES[job.stop_reason])
        summary: dict[str, Any] | None = None
        try:
            if error is not None:
                code, message = error
                job.responder.error(job, code, message)
                terminal = Terminal("error", {"id": job.id, "code": code, "message": message})
            else:
                summary = job.summary(job.stop_reason or "completed", now)
                job.responder.done(job, summary)
                terminal = Terminal("done", summary)
        except Exception:  # an answer that cannot be sent must not stop the worker
            log.exception("answering request %s failed", job.id)
            terminal = Terminal("error", {"id": job.id, "code": "internal", "message": "internal error"})
        finally:
            self.scheduler.finish(job)
        self.scheduler.record_terminal(job.id, terminal)
        route = job.route or "none"
        outcome = error[0] if error is not None else (job.stop_reason or "completed")
        total_s = now - job.request.received_at if job.request.received_at else None
        if self.metrics is not None:
            self.metrics.observe_request(summary, route, outcome, total_s)
            self.metrics.routes.labels(route=route, rule=job.route_rule or "none").inc()
        if self.log_traces:
            line = (
                summary
                if summary is not None
                else {"id": job.id, "route": job.route, "code": outcome, "message": error[1] if error else ""}
            )
            trace_log.info(json.dumps({"event": "tts_request", "outcome": outcome, **line}, default=str))
