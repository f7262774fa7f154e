"""Which request runs next: a priority queue (higher priority first, FIFO
within a priority) with a hard size limit, an estimated-wait limit, deadlines,
cancel of queued and running requests, preemption, the local engine's bound
on requests at once, and the duplicate-id memory. Pure logic behind one lock;
no I/O."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.serving.jobs import Job
from cosyedge_daemon.settings.schema import SchedulerSettings


@dataclass(frozen=True)
class Terminal:
    """The answer a finished request got, replayed to a duplicate."""

    kind: str  # "done" | "error"
    payload: dict[str, Any]  # the done summary, or {id, code, message}


class DedupeMemory:
    """Ids accepted within the window: PENDING while in flight, then the
    terminal answer. Bounded (oldest forgotten first)."""

    PENDING = "pending"

    def __init__(self, window_s: float, max_ids: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.max_ids = max_ids
        self._clock = clock
        self._seen: OrderedDict[str, tuple[float, str | Terminal]] = OrderedDict()

    def _expire(self) -> None:
        now = self._clock()
        while self._seen:
            key, (t, _) = next(iter(self._seen.items()))
            if now - t <= self.window_s and len(self._seen) <= self.max_ids:
                break
            del self._seen[key]

    def lookup(self, request_id: str) -> str | Terminal | None:
        self._expire()
        entry = self._seen.get(request_id)
        return None if entry is None else entry[1]

    def accept(self, request_id: str) -> None:
        self._seen[request_id] = (self._clock(), self.PENDING)
        self._seen.move_to_end(request_id)
        self._expire()

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)

    def complete(self, request_id: str, terminal: Terminal) -> None:
        if request_id in self._seen:
            self._seen[request_id] = (self._seen[request_id][0], terminal)


class Scheduler:
    def __init__(
        self, settings: SchedulerSettings, clock: Callable[[], float] = time.monotonic, concurrency: int = 1
    ) -> None:
        self.settings = settings
        self.concurrency = max(1, concurrency)  # requests served at once (the synthesis workers)
        self._clock = clock
        self._lock = threading.Condition()
        self._heap: list[tuple[int, int, Job]] = []
        self._queued: dict[str, Job] = {}
        self._running: dict[str, Job] = {}
        self._seq = itertools.count()
        self._closed = False
        self._service_s: float | None = None  # EWMA of start→end time of a request
        # requests routed to the local engine that run at once (its concurrent_streams); None: the workers
        self._local_limit: int | None = None
        self.dedupe = DedupeMemory(settings.dedupe_window_s, settings.dedupe_max_ids, clock)

    def reconfigure(self, settings: SchedulerSettings) -> None:
        with self._lock:
            self.settings = settings
            self.dedupe.window_s = settings.dedupe_window_s

    def set_local_limit(self, limit: int | None) -> None:
        """At most `limit` requests routed to the local engine run at once (None: as many as the
        workers): where the engine serves fewer streams at once than the daemon has workers, the
        rest wait here, counted by `depth` and the estimated wait, instead of inside the engine."""
        if limit is not None and limit < 1:
            raise ValueError(f"the local limit must be at least 1 or None, got {limit}")
        with self._lock:
            self._local_limit = limit
            self._lock.notify_all()

    @property
    def local_limit(self) -> int | None:
        return self._local_limit

    def _local_full(self, job: Job) -> bool:
        """Whether `job` is routed to the local engine and that engine's bound is reached."""
        if self._local_limit is None or job.decision is None or job.decision.target != "local":
            return False
        running = sum(1 for j in self._running.values() if j.decision is not None and j.decision.target == "local")
        return running >= self._local_limit

    # --- admission --------------------------------------------------------
    def check_duplicate(self, request_id: str) -> str | Terminal | None:
        with self._lock:
            return self.dedupe.lookup(request_id)

    def estimated_wait_s(self, priority: int) -> float:
        with self._lock:
            return self._estimate(priority)

    def _estimate(self, priority: int) -> float:
        if self._service_s is None:
            return 0.0
        ahead = sum(1 for j in self._queued.values() if j.priority >= priority)
        running = sum(
            1 for j in self._running.values() if j.priority >= priority or not self.settings.preempt
        )
        # `concurrency` requests are served at once (fewer where the local engine is bound), each taking
        # about `_service_s`.
        at_once = min(self.concurrency, self._local_limit or self.concurrency)
        return (ahead + running) * self._service_s / at_once

    def submit(self, job: Job) -> list[Job]:
        """Queue the job; returns the running jobs it preempts (the caller
        stops them). Raises ApiError busy / shutting_down / duplicate."""
        with self._lock:
            if self._closed:
                raise ApiError("shutting_down", "the daemon is shutting down; try again later", job.id)
            if len(self._queued) >= self.settings.max_queue:
                raise ApiError("busy", f"the queue is full ({self.settings.max_queue} requests)", job.id)
            wait_s = self._estimate(job.priority)
            if self.settings.max_wait_ms and wait_s * 1000.0 > self.settings.max_wait_ms:
                raise ApiError(
                    "busy",
                    f"the estimated wait ({wait_s * 1000:.0f} ms) exceeds max_wait_ms "
                    f"({self.settings.max_wait_ms} ms)",
                    job.id,
                )
            if job.id in self._queued or job.id in self._running:
                raise ApiError("duplicate", "a request with this id is in progress", job.id)
            heapq.heappush(self._heap, (-job.priority, next(self._seq), job))
            self._queued[job.id] = job
            if job.request.client_id:
                self.dedupe.accept(job.id)
            preempted = []
            if self.settings.preempt:
                preempted = [j for j in self._running.values() if j.priority < job.priority]
            self._lock.notify()
            return preempted

    # --- the worker side ----------------------------------------------------
    def next(self, timeout_s: float | None = None) -> Job | None:
        """The next job (marked running), or None after the timeout / close. A job for the
        local engine at its bound stays queued; a later job for another target may go first."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        with self._lock:
            while True:
                job = self._pop_runnable()
                if job is not None:
                    del self._queued[job.id]
                    self._running[job.id] = job
                    job.started_at = self._clock()
                    return job
                if self._closed:
                    return None
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    return None
                self._lock.wait(remaining)

    def _pop_runnable(self) -> Job | None:
        """The first queued job in priority order that may run now, off the heap; the jobs it
        passes over for the local bound go back (cancelled and expired ones are dropped)."""
        passed: list[tuple[int, int, Job]] = []
        found = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            job = entry[2]
            if self._queued.get(job.id) is not job:  # cancelled or expired while queued
                continue
            if self._local_full(job):
                passed.append(entry)
                continue
            found = job
            break
        for entry in passed:
            heapq.heappush(self._heap, entry)
        return found

    def finish(self, job: Job) -> None:
        with self._lock:
            if self._running.pop(job.id, None) is job and job.started_at is not None:
                took = self._clock() - job.started_at
                self._service_s = took if self._service_s is None else 0.8 * self._service_s + 0.2 * took
            if self._local_limit is not None:
                self._lock.notify_all()  # a local job held at the bound may run now

    def record_terminal(self, request_id: str, terminal: Terminal) -> None:
        with self._lock:
            self.dedupe.complete(request_id, terminal)

    # --- control ----------------------------------------------------------------
    def cancel(self, request_id: str) -> tuple[Job | None, bool]:
        """(job, was_queued): a queued job is removed; a running one is returned
        for the caller to stop."""
        with self._lock:
            job = self._queued.pop(request_id, None)
            if job is not None:
                return job, True
            return self._running.get(request_id), False

    def expired(self, now: float | None = None) -> tuple[list[Job], list[Job]]:
        """(queued jobs past their deadline, removed; running ones without
        audio by their deadline, left for the caller to stop)."""
        now = self._clock() if now is None else now
        queued, running = [], []
        with self._lock:
            for job in list(self._queued.values()):
                if job.deadline_at is not None and now >= job.deadline_at:
                    del self._queued[job.id]
                    queued.append(job)
            for job in self._running.values():
                if job.deadline_at is not None and now >= job.deadline_at and job.first_audio_at is None:
                    running.append(job)
        return queued, running

    def close(self) -> list[Job]:
        """Stop accepting; return the jobs still queued (removed)."""
        with self._lock:
            self._closed = True
            jobs = list(self._queued.values())
            self._queued.clear()
            self._heap.clear()
            self._lock.notify_all()
            return jobs

    def running(self) -> list[Job]:
        with self._lock:
            return list(self._running.values())

    @property
    def depth(self) -> int:
        with self._lock:
            return len(self._queued)

    @property
    def closed(self) -> bool:
        return self._closed

    def degraded(self) -> bool:
        return self.depth >= self.settings.degraded_queue_depth
