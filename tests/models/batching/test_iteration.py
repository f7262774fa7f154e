"""The iteration-level scheduler of the fixed-shape LLM path as pure logic
(models/batching/iteration.py): joins and leaves at step boundaries, padding
to the captured sizes, rows reused, and the bound on how many prefills a
running stream waits for between two of its steps (counted, not timed)."""

from __future__ import annotations

import random

import pytest
from cosyedge_models.batching.batched_step import padded_size
from cosyedge_models.batching.iteration import IterationScheduler, IterationSettings
from cosyedge_models.batching.policy import BatchSettings


def _sched(max_batch: int = 4, sizes: tuple[int, ...] = (1, 2, 4), rows: int = 4, bound: int = 1,
           **batch: object) -> IterationScheduler:
    return IterationScheduler(IterationSettings(BatchSettings(max_batch_size=max_batch, **batch),  # type: ignore[arg-type]
                                                sizes, rows, bound))


def _simulate(s: IterationScheduler, arrivals: dict[int, list[tuple[int, int]]], rounds: int) -> list[tuple]:
    """Rounds of the scheduler; arrivals: round -> [(key, steps it takes)]. The trace:
    ("prefill", key, row) and ("step", keys, rows, batch_size) events in order."""
    remaining: dict[int, int] = {}
    trace: list[tuple] = []
    for r in range(rounds):
        for key, steps in arrivals.get(r, []):
            s.arrive(key, now=float(r))
            remaining[key] = steps
        for p in s.prefills(now=float(r)).run:
            trace.append(("prefill", p.key, p.row))
            s.prefilled(p.key, finished=remaining[p.key] == 0)
        batch = s.batch()
        if batch is not None:
            trace.append(("step", batch.keys, batch.rows, batch.batch_size))
            for key in batch.keys:
                remaining[key] -= 1
                s.stepped(key, finished=remaining[key] == 0)
    return trace


def test_padded_size_is_the_next_captured_size() -> None:
    assert [padded_size(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="largest captured batch size"):
        padded_size(9, (1, 2, 4, 8))


def test_streams_join_at_the_next_step_and_leave_when_done() -> None:
    s = _sched(bound=4)
    trace = _simulate(s, {0: [(10, 2), (11, 4)], 2: [(12, 1)]}, rounds=6)
    assert trace == [
        ("prefill", 10, 0), ("prefill", 11, 1),
        ("step", (10, 11), (0, 1), 2),
        ("step", (10, 11), (0, 1), 2),  # 10 has taken its 2 steps: it leaves, row 0 is free
        ("prefill", 12, 0),  # the newcomer gets the lowest free row and joins this round's step
        ("step", (12, 11), (0, 1), 2),
        ("step", (11,), (1,), 1),
    ]
    assert s.running == [] and s.pending_prefills == 0


def test_batch_is_padded_to_the_captured_size() -> None:
    s = _sched(bound=3)
    trace = _simulate(s, {0: [(1, 3), (2, 3), (3, 3)]}, rounds=1)
    assert trace[-1] == ("step", (1, 2, 3), (0, 1, 2), 4)


def test_a_stream_done_at_its_prefill_never_takes_a_step() -> None:
    s = _sched()
    trace = _simulate(s, {0: [(1, 0)], 1: [(2, 1)]}, rounds=3)
    assert trace == [("prefill", 1, 0), ("prefill", 2, 0), ("step", (2,), (0,), 1)]


@pytest.mark.parametrize("bound", [1, 2, 3])
def test_running_streams_wait_at_most_the_bound_in_prefills(bound: int) -> None:
    rng = random.Random(bound)
    arrivals: dict[int, list[tuple[int, int]]] = {}
    for key in range(40):
        arrivals.setdefault(rng.randrange(60), []).append((key, rng.randrange(0, 12)))
    s = _sched(max_batch=8, sizes=(1, 2, 4, 8), rows=8, bound=bound)
    trace = _simulate(s, arrivals, rounds=400)
    # Every stream ran, and took exactly its steps.
    steps = {key: sum(key in e[1] for e in trace if e[0] == "step") for key in range(40)}
    assert steps == {k: n for r in arrivals.values() for k, n in r}
    # Between two steps of a stream that keeps running, at most `bound` prefills.
    running: set[int] = set()
    since = 0
    worst = 0
    for e in trace:
        if e[0] == "prefill":
            since += 1
            if running:
                worst = max(worst, since)
        else:
            running = set(e[1])
            since = 0
            assert len(e[2]) <= e[3] and len(set(e[2])) == len(e[2])  # padded, one row per stream
    assert worst == bound  # reached (arrivals bunch up) and never exceeded


def test_admission_follows_the_batch_policy() -> None:
    # max 2 active: the third waits for a row; priority goes first
    s = _sched(max_batch=2, bound=4)
    s.arrive(1, now=0.0)
    s.arrive(2, now=0.0)
    s.arrive(3, now=0.0, priority=5)
    assert [p.key for p in s.prefills(now=0.0).run] == [3, 1]
    assert s.waiting == 1
    # a queue delay holds a lone arrival back until its deadline
    d = _sched(bound=1, max_queue_delay_ms=50.0, preferred_batch_sizes=(2,))
    d.arrive(7, now=1.0)
    first = d.prefills(now=1.0)
    assert first.run == () and first.wake_at == pytest.approx(1.05)
    assert [p.key for p in d.prefills(now=1.05).run] == [7]


def test_bad_settings_and_calls_are_refused() -> None:
    with pytest.raises(ValueError, match="exceeds what the step holds"):
        _sched(max_batch=8, sizes=(1, 2, 4), rows=8)
    with pytest.raises(ValueError, match="distinct ascending"):
        _sched(sizes=(4, 2))
    with pytest.raises(ValueError, match=">= 1 prefill"):
        _sched(bound=0)
    s = _sched(max_queue_size=1)
    s.arrive(1, now=0.0)
    with pytest.raises(ValueError, match="already scheduled"):
        s.arrive(1, now=0.0)
    with pytest.raises(OverflowError, match="max_queue_size"):
        s.arrive(2, now=0.0)
    with pytest.raises(ValueError, match="not running"):
        s.stepped(1, finished=True)
    s.remove(1)
    assert s.waiting == 0
