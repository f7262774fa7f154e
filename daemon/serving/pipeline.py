"""The speaking path: N synthesis workers and one playback worker. Each
synthesis worker takes the next job from the scheduler (in its priority
order), runs it on the routed engine (retrying on the fallback when the
engine fails before any audio went out), publishes chunks for `publish`
outputs and hands chunks for `play` outputs to the playback side
(daemon/serving/playback.py), which plays one request at a time in the order the
workers took them. The engine is shared: its LLM batcher batches the
workers' concurrent requests, with each request's priority."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
from cosyedge_daemon.audio.interfaces import AudioSink
from cosyedge_daemon.request.errors import SYNTHESIZER_UNAVAILABLE, ApiError
from cosyedge_daemon.serving.answer import Completer
from cosyedge_daemon.serving.jobs import Job
from cosyedge_daemon.serving.playback import TICK_S, Error, PlaybackOrder, PlaybackWorker
from cosyedge_daemon.serving.scheduler import Scheduler
from cosyedge_daemon.settings.schema import SchedulerSettings
from cosyedge_daemon.synthesizers.routing import RouteDecision, Router
from cosyedge_models.errors import RequestError
from cosyedge_models.synthesis.api import AudioChunk, ServedSynthesizer

log = logging.getLogger(__name__)

PLAYBACK = "playback"


class DeliveryError(Exception):
    """Handing a chunk to its responder or the speaker failed: the request's
    fault or the connection's, never the engine's (its health is not touched)."""


def worker_names(count: int) -> list[str]:
    """The synthesis workers' thread names (the health document's `workers` keys)."""
    return [f"synthesis-{n}" for n in range(1, count + 1)]


class Pipeline:
    def __init__(
        self,
        scheduler: Scheduler,
        router: Router,
        completer: Completer,
        settings: SchedulerSettings,
        sink: AudioSink | None = None,
        on_speaking: Callable[[bool], None] | None = None,
        workers: int = 1,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.scheduler = scheduler
        self.router = router
        self.completer = completer
        self.settings = settings
        self.sink = sink
        self.workers = workers
        self.order = PlaybackOrder()
        self.player = PlaybackWorker(sink, self.order, completer, on_speaking) if sink is not None else None
        self.heartbeats: dict[str, float] = {}
        self._synthesizing: dict[str, Job] = {}  # worker name -> its job
        self._take_lock = threading.Lock()  # taking a job and reserving its playback turn are one step
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._synthesis_loop, name=name, daemon=True)
            for name in worker_names(self.workers)
        ]
        if self.player is not None:
            self._threads.append(
                threading.Thread(target=self.player.run, args=(self._stop,), name=PLAYBACK, daemon=True)
            )
        for t in self._threads:
            self.heartbeats[t.name] = time.monotonic()
            t.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Workers finish their current job and exit; queued jobs stay with the
        scheduler (the service answers them)."""
        self.order.close()  # first: the playback worker answers every ended lane before it exits
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def workers_alive(self, stall_s: float) -> dict[str, bool]:
        now = time.monotonic()
        if self.player is not None:
            self.heartbeats[PLAYBACK] = self.player.heartbeat
        return {
            t.name: t.is_alive() and now - self.heartbeats.get(t.name, 0.0) < stall_s for t in self._threads
        }

    def idle(self) -> bool:
        return not self._synthesizing and not self.order.pending()

    @property
    def active_syntheses(self) -> int:
        """Requests on a synthesis worker now (including those waiting for their turn to play)."""
        return len(self._synthesizing)

    @property
    def playing_job(self) -> Job | None:
        return self.player.playing_job if self.player is not None else None

    # --- control from other threads ---------------------------------------------------
    def stop_job(self, job: Job, reason: str) -> bool:
        """Stop a running job: its synthesis ends at the engine's next step, its
        audio stops at once when it is playing, and it is answered now when
        it only waited for its turn to play."""
        if not job.stop(reason):
            return False
        if self.sink is not None and self.playing_job is job:
            self.sink.flush()
        for lane in self.order.take_stopped():
            self.completer.complete(lane.job, lane.error)
        self.order.wake()
        return True

    def interrupt_playing(self, reason: str = "interrupted") -> Job | None:
        job = self.playing_job
        if job is not None and self.stop_job(job, reason):
            return job
        return None

    @property
    def speaking(self) -> bool:
        return self.player.speaking if self.player is not None else False

    # --- synthesis workers ---------------------------------------------------------
    def _beat(self) -> None:
        self.heartbeats[threading.current_thread().name] = time.monotonic()

    def _take(self) -> Job | None:
        """The scheduler's next job; a playing one gets its playback turn in the
        same step, so turns follow the scheduler's order across workers."""
        if not self._take_lock.acquire(timeout=TICK_S):
            return None
        try:
            job = self.scheduler.next(TICK_S)
            if job is not None and job.plays and self.sink is not None:
                self.order.open(job)
            return job
        finally:
            self._take_lock.release()

    def _synthesis_loop(self) -> None:
        name = threading.current_thread().name
        while not self._stop.is_set():
            self._beat()
            job = self._take()
            if job is None:
                continue
            self._synthesizing[name] = job
            try:
                self._serve(job)
            except Exception:  # never lose the worker (the answer is out already or comes from _serve)
                log.exception("worker %s: request %s failed", name, job.id)
            finally:
                del self._synthesizing[name]

    def _serve(self, job: Job) -> None:
        error: Error | None = None
        try:
            error = self._run_job(job)
        except Exception as exc:  # answer the request whatever went wrong
            log.exception("request %s failed", job.id)
            error = ("internal", f"internal error: {exc}")
        self.end_job(job, error)

    def end_job(self, job: Job, error: Error | None = None) -> None:
        """A job's audio is all out (or it failed): answered now, or by the
        playback worker once its queued audio played."""
        job.synth_done_at = time.monotonic()
        if not (job.plays and self.sink is not None) or self.order.end(job, error):
            self.completer.complete(job, error)

    def _run_job(self, job: Job) -> Error | None:
        deadline = job.deadline_at
        if deadline is not None and time.monotonic() >= deadline:
            job.stop("deadline_exceeded")
        if job.cancel.is_set():
            return None
        try:
            # decided when the request was accepted (jobs made elsewhere are admitted here)
            decision = job.decision if job.decision is not None else self.router.admit(job.request)
            return self._synthesize(job, decision)
        except ApiError as exc:
            return (exc.code, exc.message)

    def _synthesize(self, job: Job, decision: RouteDecision) -> Error | None:
        """Run the job through the engines; an error tuple when it failed."""
        tried: set[str] = set()
        while True:
            job.route, job.route_reason, job.route_rule = decision.target, decision.reason, decision.rule
            tried.add(decision.target)
            slot = self.router.synthesizers.slots[decision.target]
            if not slot.healthy:  # it went away while the job waited: on as after a failure
                moved = self.router.after_failure(
                    decision, "it became unavailable while the request waited", audio_out=False,
                    request=job.request, tried=tried,
                )
                if moved is None:
                    return (SYNTHESIZER_UNAVAILABLE, f"the {decision.target} engine is unavailable")
                decision = moved
                continue
            try:
                with self.router.synthesizers.lease(decision.target) as engine:
                    job.engine_name = engine.name
                    self._hint_load(engine)
                    # built and validated once, at admission, by this very synthesizer (else built here)
                    validated = decision.request is not None and decision.validated_by is engine
                    request = decision.request if validated and decision.request is not None else \
                        job.request.synthesis_request(fallback=decision.target == "fallback")
                    # the cloud takes the job's id and deadline along; other synthesizers ignore them
                    run = engine.for_job(job.id, job.deadline_at, validated=validated)
                    for chunk in run(request, cancel=job.cancel):
                        if job.cancel.is_set():
                            break
                        try:
                            self._deliver(job, chunk)
                        except Exception as exc:
                            raise DeliveryError(str(exc)) from exc
                        self._beat()
                slot.report(True)
                return None
            except RequestError as exc:  # the engine rejected the request itself
                return (exc.code, str(exc))
            except ApiError as exc:
                return (exc.code, exc.message)
            except DeliveryError as exc:
                log.warning("request %s: delivering its audio failed: %s", job.id, exc)
                return ("delivery_failed", f"delivering the audio failed: {exc}")
            except Exception as exc:
                if job.cancel.is_set():
                    return None
                slot.report(False)
                log.warning("engine %s failed on request %s: %s", decision.target, job.id, exc)
                following = self.router.after_failure(
                    decision, str(exc), audio_out=job.chunks_out > 0, request=job.request, tried=tried
                )
                if following is None:
                    return ("engine_error", f"the {decision.target} engine failed: {exc}")
                decision = following

    def _hint_load(self, engine: ServedSynthesizer) -> None:
        # under load an engine may cut its batching delay
        engine.set_load_level("degraded" if self.scheduler.degraded() else "normal")

    def _ahead_limit(self) -> int:
        n = self.settings.synth_ahead_chunks
        return max(1, n // 4) if self.scheduler.degraded() else n

    def _deliver(self, job: Job, chunk: AudioChunk) -> None:
        pcm = np.asarray(chunk.pcm, dtype=np.float32).reshape(-1)
        job.sample_rate = chunk.sample_rate
        job.stage_times = chunk.times.as_dict()
        seq = job.chunks_out
        job.chunks_out += 1
        job.samples_out += pcm.size
        if job.publishes:
            job.responder.audio(job, pcm, chunk.sample_rate, seq, chunk.last)
            job.mark_audio_out()
        if job.plays and self.sink is not None:
            # Waits (bounded) while an earlier request plays; publishing never waits here.
            self.order.put_chunk(job, pcm, chunk.sample_rate, self._ahead_limit, self._beat)
