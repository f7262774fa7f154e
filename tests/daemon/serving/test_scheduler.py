from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.request.request import TtsRequest
from cosyedge_daemon.serving.jobs import Job
from cosyedge_daemon.serving.scheduler import DedupeMemory, Scheduler, Terminal
from cosyedge_daemon.settings.schema import SchedulerSettings


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class NullResponder:
    def audio(self, job: Job, pcm: np.ndarray, sample_rate: int, seq: int, last: bool) -> None: ...

    def done(self, job: Job, summary: dict[str, Any]) -> None: ...

    def error(self, job: Job, code: str, message: str) -> None: ...


def job(rid: str, priority: int = 0, deadline_ms: int | None = None, at: float = 1000.0) -> Job:
    return Job(
        TtsRequest(id=rid, text="x", priority=priority, deadline_ms=deadline_ms, received_at=at),
        NullResponder(),
    )


def test_priority_then_fifo() -> None:
    s = Scheduler(SchedulerSettings(max_wait_ms=0))
    for rid, prio in [("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1)]:
        s.submit(job(rid, prio))
    order = [s.next(0).id for _ in range(5)]  # type: ignore[union-attr]
    assert order == ["b", "d", "a", "c", "e"]
    assert s.next(0.01) is None


def test_queue_limit_is_busy() -> None:
    s = Scheduler(SchedulerSettings(max_queue=2, max_wait_ms=0))
    s.submit(job("a"))
    s.submit(job("b"))
    with pytest.raises(ApiError) as err:
        s.submit(job("c"))
    assert err.value.code == "busy" and "queue is full" in err.value.message
    assert s.check_duplicate("c") is None  # a rejected id may be sent again


def test_estimated_wait_limit() -> None:
    clock = Clock()
    s = Scheduler(SchedulerSettings(max_wait_ms=2500), clock=clock)
    first = job("a")
    s.submit(first)
    s.next(0)
    clock.t += 1.0  # a request takes 1 s
    s.finish(first)
    s.submit(job("b"))
    s.submit(job("c"))
    s.submit(job("d"))  # waits for b and c: 2 s
    with pytest.raises(ApiError, match="estimated wait"):
        s.submit(job("e"))  # would wait 3 s > 2.5 s
    s.submit(job("urgent", priority=9))  # nothing ahead of it


def served_one(s: Scheduler, clock: Clock, took_s: float) -> None:
    """One request through `s` that took `took_s` (the service-time estimate's first sample)."""
    first = job("a")
    s.submit(first)
    s.next(0)
    clock.t += took_s
    s.finish(first)


def test_estimated_wait_counts_the_requests_served_at_once() -> None:
    clock = Clock()
    s = Scheduler(SchedulerSettings(max_wait_ms=2500), clock=clock, concurrency=2)
    served_one(s, clock, 1.0)  # a request takes 1 s; two run at once
    for rid in "bcde":
        s.submit(job(rid))
    assert s.estimated_wait_s(0) == 2.0  # four ahead, two at a time
    s.submit(job("f"))  # 2 s
    s.submit(job("g"))  # 2.5 s: at the limit
    with pytest.raises(ApiError, match="estimated wait"):
        s.submit(job("h"))  # 3 s (one at a time it would be 6 s)


def test_cancel_queued_and_running() -> None:
    s = Scheduler(SchedulerSettings(max_wait_ms=0))
    s.submit(job("a"))
    s.submit(job("b"))
    running = s.next(0)
    assert running is not None and running.id == "a"
    queued, was_queued = s.cancel("b")
    assert queued is not None and queued.id == "b" and was_queued is True
    j, was_queued = s.cancel("a")
    assert j is running and was_queued is False
    assert s.cancel("zzz") == (None, False)
    assert s.next(0.01) is None  # b is gone from the queue


def test_cancelled_then_same_id_requeued_is_not_lost() -> None:
    s = Scheduler(SchedulerSettings(max_wait_ms=0, dedupe_window_s=0))
    s.submit(job("a"))
    s.cancel("a")
    again = job("a")
    s.submit(again)
    assert s.next(0) is again


def test_preemption_returns_lower_running_jobs() -> None:
    s = Scheduler(SchedulerSettings(preempt=True, max_wait_ms=0))
    s.submit(job("low", 0))
    s.next(0)
    assert [j.id for j in s.submit(job("same", 0))] == []
    assert [j.id for j in s.submit(job("high", 3))] == ["low"]
    off = Scheduler(SchedulerSettings(preempt=False, max_wait_ms=0))
    off.submit(job("low", 0))
    off.next(0)
    assert off.submit(job("high", 3)) == []


def test_deadlines() -> None:
    clock = Clock()
    s = Scheduler(SchedulerSettings(max_wait_ms=0), clock=clock)
    s.submit(job("q", deadline_ms=500, at=clock.t))
    s.submit(job("r", deadline_ms=500, at=clock.t))
    s.submit(job("keep", deadline_ms=5000, at=clock.t))
    running = s.next(0)
    assert running is not None and running.id == "q"
    clock.t += 0.6
    queued, late = s.expired()
    assert [j.id for j in queued] == ["r"] and [j.id for j in late] == ["q"]
    running.mark_audio_out(clock.t)
    assert s.expired() == ([], [])
    assert s.next(0).id == "keep"  # type: ignore[union-attr]


def test_close_returns_queued_and_refuses() -> None:
    s = Scheduler(SchedulerSettings(max_wait_ms=0))
    s.submit(job("a"))
    assert [j.id for j in s.close()] == ["a"]
    with pytest.raises(ApiError) as err:
        s.submit(job("b"))
    assert err.value.code == "shutting_down"
    assert s.next(1.0) is None


def test_dedupe_memory_window_and_bound() -> None:
    clock = Clock()
    d = DedupeMemory(window_s=10, max_ids=16, clock=clock)
    d.accept("a")
    assert d.lookup("a") == DedupeMemory.PENDING
    d.complete("a", Terminal("done", {"id": "a"}))
    assert d.lookup("a") == Terminal("done", {"id": "a"})
    clock.t += 11
    assert d.lookup("a") is None
    for i in range(40):
        d.accept(f"id{i}")
    assert d.lookup("id0") is None and d.lookup("id39") == DedupeMemory.PENDING


def test_degraded_from_depth() -> None:
    s = Scheduler(SchedulerSettings(degraded_queue_depth=2, max_wait_ms=0))
    s.submit(job("a"))
    assert not s.degraded()
    s.submit(job("b"))
    assert s.degraded()


def test_only_ids_the_client_chose_are_remembered() -> None:
    """Made-up ids (no id sent, Wyoming, the satellite) are never resent: remembering them
    would fill the bounded memory and push out the ids clients may resend."""
    s = Scheduler(SchedulerSettings(max_wait_ms=0, dedupe_max_ids=16, max_queue=100))
    s.submit(job("mine"))
    for i in range(40):
        made_up = job(f"wyoming-{i}")
        s.submit(Job(dataclasses.replace(made_up.request, client_id=False), made_up.responder))
    assert s.check_duplicate("mine") == DedupeMemory.PENDING
    assert s.check_duplicate("wyoming-0") is None and s.check_duplicate("wyoming-39") is None


def routed(rid: str, target: str, priority: int = 0) -> Job:
    from cosyedge_daemon.synthesizers.routing import RouteDecision

    j = job(rid, priority)
    j.decision = RouteDecision(target, "test")  # type: ignore[arg-type]
    return j


def test_local_jobs_beyond_the_engines_bound_wait_and_others_pass_them() -> None:
    s = Scheduler(SchedulerSettings(max_wait_ms=0), concurrency=4)
    s.set_local_limit(2)
    for j in (routed("l1", "local"), routed("l2", "local"), routed("l3", "local", priority=5), routed("c1", "cloud")):
        s.submit(j)
    taken = [s.next(0), s.next(0), s.next(0)]
    assert [j.id for j in taken if j is not None] == ["l3", "l1", "c1"]  # l2 held: two local already run
    assert s.next(0) is None and s.depth == 1
    s.finish(taken[0])  # type: ignore[arg-type]
    nxt = s.next(0)
    assert nxt is not None and nxt.id == "l2"
    s.set_local_limit(None)
    s.submit(routed("l4", "local"))
    assert (got := s.next(0)) is not None and got.id == "l4"  # no bound: three local at once
    with pytest.raises(ValueError, match="at least 1"):
        s.set_local_limit(0)


def test_a_held_local_job_runs_as_soon_as_a_local_one_finishes() -> None:
    import threading

    s = Scheduler(SchedulerSettings(max_wait_ms=0), concurrency=2)
    s.set_local_limit(1)
    first = routed("a", "local")
    s.submit(first)
    assert s.next(0) is first
    s.submit(routed("b", "local"))
    got: list[Job | None] = []
    waiter = threading.Thread(target=lambda: got.append(s.next(5.0)))
    waiter.start()
    s.finish(first)  # wakes the waiting worker at once (not after its 5 s timeout)
    waiter.join(2.0)
    assert not waiter.is_alive() and got[0] is not None and got[0].id == "b"


def test_the_estimated_wait_counts_the_local_bound() -> None:
    clock = Clock()
    s = Scheduler(SchedulerSettings(max_wait_ms=0), clock=clock, concurrency=4)
    served_one(s, clock, 1.0)
    for rid in "bcde":
        s.submit(job(rid))
    assert s.estimated_wait_s(0) == 1.0  # four ahead, four at a time
    s.set_local_limit(2)
    assert s.estimated_wait_s(0) == 2.0  # two at a time
