"""The two workers of the speaking path. The synthesis worker takes the next
job from the scheduler, runs it on the routed engine (retrying on the
fallback when the engine fails before any audio went out), publishes chunks
for `publish` outputs and hands chunks for `play` outputs to the playback
worker through a bounded queue, so the next chunk (or request) is
synthesized while the current one plays. The playback worker writes to the
AudioSink, starting on the first chunk."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import soxr

from daemon.audio.interfaces import AudioSink
from daemon.completion import Completer
from daemon.jobs import Job
from daemon.routing import RouteDecision, Router
from daemon.scheduler import Scheduler
from daemon.settings import SchedulerSettings
from daemon.tts_api import ApiError
from models.api import AudioChunk, Engine
from models.errors import RequestError

log = logging.getLogger(__name__)

_TICK_S = 0.25  # worker loops wake at least this often (heartbeats, stop flag)
_WRITE_BLOCK_MS = 100  # playback writes in blocks this long: a stop lands within one block


@dataclass
class _Chunk:
    job: Job
    pcm: np.ndarray
    sample_rate: int


@dataclass
class _End:
    job: Job
    error: tuple[str, str] | None = None  # the engine failed after some audio was queued


class PlaybackQueue:
    """Bounded hand-over between the workers. The bound can shrink under load;
    chunks of a stopped job are not waited for; end markers always fit."""

    def __init__(self) -> None:
        self._items: collections.deque[_Chunk | _End] = collections.deque()
        self._cond = threading.Condition()

    def put_chunk(self, item: _Chunk, limit: Callable[[], int]) -> bool:
        with self._cond:
            while sum(isinstance(i, _Chunk) for i in self._items) >= limit():
                if item.job.cancel.is_set():
                    return False
                self._cond.wait(_TICK_S)
            self._items.append(item)
            self._cond.notify_all()
            return True

    def put_end(self, item: _End) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def get(self, timeout_s: float) -> _Chunk | _End | None:
        with self._cond:
            if not self._items:
                self._cond.wait(timeout_s)
            if not self._items:
                return None
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


class Pipeline:
    def __init__(
        self,
        scheduler: Scheduler,
        router: Router,
        completer: Completer,
        settings: SchedulerSettings,
        sink: AudioSink | None = None,
        on_speaking: Callable[[bool], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.router = router
        self.completer = completer
        self.settings = settings
        self.sink = sink
        self.on_speaking = on_speaking
        self.queue = PlaybackQueue()
        self.heartbeats: dict[str, float] = {}
        self.playing_job: Job | None = None
        self.synth_job: Job | None = None
        self._speaking = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._resampler: tuple[Job, soxr.ResampleStream] | None = None

    # --- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        self._threads = [threading.Thread(target=self._synthesis_loop, name="synthesis", daemon=True)]
        if self.sink is not None:
            self._threads.append(threading.Thread(target=self._playback_loop, name="playback", daemon=True))
        for t in self._threads:
            self.heartbeats[t.name] = time.monotonic()
            t.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.queue.wake()
        for t in self._threads:
            t.join(timeout_s)

    def workers_alive(self, stall_s: float) -> dict[str, bool]:
        now = time.monotonic()
        return {
            t.name: t.is_alive() and now - self.heartbeats.get(t.name, 0.0) < stall_s for t in self._threads
        }

    def idle(self) -> bool:
        return self.synth_job is None and self.playing_job is None and len(self.queue) == 0

    # --- control from other threads ---------------------------------------------------
    def stop_job(self, job: Job, reason: str) -> bool:
        """Stop a running job; its audio stops at once when it is playing."""
        if not job.stop(reason):
            return False
        if self.sink is not None and self.playing_job is job:
            self.sink.flush()
        self.queue.wake()
        return True

    def interrupt_playing(self, reason: str = "interrupted") -> Job | None:
        job = self.playing_job
        if job is not None and self.stop_job(job, reason):
            return job
        return None

    @property
    def speaking(self) -> bool:
        return self._speaking

    def _set_speaking(self, value: bool) -> None:
        if value != self._speaking:
            self._speaking = value
            if self.on_speaking is not None:
                try:
                    self.on_speaking(value)
                except Exception:
                    log.exception("speaking-state callback failed")

    # --- synthesis worker ----------------------------------------------------------
    def _synthesis_loop(self) -> None:
        name = threading.current_thread().name
        while not self._stop.is_set():
            self.heartbeats[name] = time.monotonic()
            job = self.scheduler.next(_TICK_S)
            if job is None:
                continue
            self.synth_job = job
            try:
                self._run_job(job)
            except Exception as exc:  # never lose the worker; answer the request
                log.exception("request %s failed", job.id)
                self.completer.complete(job, ("internal", f"internal error: {exc}"))
            finally:
                self.synth_job = None

    def _run_job(self, job: Job) -> None:
        deadline = job.deadline_at
        if deadline is not None and time.monotonic() >= deadline:
            job.stop("deadline_exceeded")
        error: tuple[str, str] | None = None
        if not job.cancel.is_set():
            try:
                decision = self.router.decide(job.request)
                error = self._synthesize(job, decision)
            except ApiError as exc:
                error = (exc.code, exc.message)
        job.synth_done_at = time.monotonic()
        if job.plays and self.sink is not None and job.chunks_out:
            self.queue.put_end(_End(job, error))  # answered after the queued audio played
        else:
            self.completer.complete(job, error)

    def _synthesize(self, job: Job, decision: RouteDecision) -> tuple[str, str] | None:
        """Run the job through the engines; an error tuple when it failed."""
        tried: set[str] = set()
        while True:
            job.route, job.route_reason, job.route_rule = decision.target, decision.reason, decision.rule
            tried.add(decision.target)
            slot = self.router.engines.slots[decision.target]
            try:
                with self.router.engines.lease(decision.target) as engine:
                    job.engine_name = engine.name
                    self._hint_load(engine)
                    request = job.request.synthesis_request(fallback=decision.target == "fallback")
                    # Optional engine hook: the cloud takes the job's id and deadline along.
                    for_job = getattr(engine, "for_job", None)
                    synthesize = for_job(job.id, job.deadline_at) if callable(for_job) else engine.synthesize
                    for chunk in synthesize(request, cancel=job.cancel):
                        if job.cancel.is_set():
                            break
                        self._deliver(job, chunk)
                        self.heartbeats["synthesis"] = time.monotonic()
                slot.report(True)
                return None
            except RequestError as exc:  # the engine rejected the request itself
                return (exc.code, str(exc))
            except ApiError as exc:
                return (exc.code, exc.message)
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

    def _hint_load(self, engine: Engine) -> None:
        # Optional engine hook: under load an engine may cut its batching delay.
        hint = getattr(engine, "set_load_level", None)
        if callable(hint):
            hint("degraded" if self.scheduler.degraded() else "normal")

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
            self.queue.put_chunk(_Chunk(job, pcm, chunk.sample_rate), self._ahead_limit)

    # --- playback worker -------------------------------------------------------------
    def _playback_loop(self) -> None:
        assert self.sink is not None
        name = threading.current_thread().name
        while not self._stop.is_set() or len(self.queue):
            self.heartbeats[name] = time.monotonic()
            item = self.queue.get(_TICK_S)
            if item is None:
                self._set_speaking(bool(self.sink.playing))
                continue
            job = item.job
            if isinstance(item, _Chunk):
                if job.cancel.is_set():
                    continue
                self.playing_job = job
                self._set_speaking(True)
                if job.playback_started_at is None:
                    job.playback_started_at = time.monotonic()
                job.mark_audio_out()
                self._write(job, self._to_sink_rate(job, item))
            else:
                self._finish_playback(job, item.error)

    def _write(self, job: Job, pcm: np.ndarray) -> None:
        """Write in short blocks so a stop takes effect within one block."""
        assert self.sink is not None
        step = max(1, self.sink.sample_rate * _WRITE_BLOCK_MS // 1000)
        for start in range(0, pcm.size, step):
            if job.cancel.is_set() or self._stop.is_set():
                self.sink.flush()
                return
            self.sink.write(pcm[start : start + step])
        if job.cancel.is_set():
            self.sink.flush()

    def _finish_playback(self, job: Job, error: tuple[str, str] | None) -> None:
        assert self.sink is not None
        if self._resampler is not None and self._resampler[0] is job and not job.cancel.is_set():
            self.sink.write(self._resampler[1].resample_chunk(np.zeros(0, dtype=np.float32), last=True))
        while not job.cancel.is_set() and not self._stop.is_set():
            self.heartbeats["playback"] = time.monotonic()
            if self.sink.drain(_TICK_S):
                break
        if job.cancel.is_set():
            self.sink.flush()
        self.playing_job = None
        self._resampler = None
        if not len(self.queue):  # silent before `done` goes out
            self._set_speaking(False)
        self.completer.complete(job, error)

    def _to_sink_rate(self, job: Job, item: _Chunk) -> np.ndarray:
        assert self.sink is not None
        if item.sample_rate == self.sink.sample_rate:
            return item.pcm
        if self._resampler is None or self._resampler[0] is not job:
            self._resampler = (
                job,
                soxr.ResampleStream(item.sample_rate, self.sink.sample_rate, 1, dtype="float32"),
            )
        return self._resampler[1].resample_chunk(item.pcm)
