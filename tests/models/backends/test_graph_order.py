"""The graph thread's work order (GraphWorkOrder in models/backends/graph_thread.py): a request's
first-chunk work (FIRST_AUDIO) runs ahead of the rest; the rest (NORMAL and
LLM) first in first out; LLM work waits while a first-audio hold is open, and
is never starved (the overtake bound, the hold's age bound). The clock is passed
in, so every order here is exact; then the same order on a real GraphThread,
its worker held on a gate so that the queue is filled before anything runs."""

from __future__ import annotations

import threading

import pytest
from cosyedge_models.backends.graph_thread import GraphPriority, GraphThread, GraphWorkOrder

FIRST, NORMAL, LLM = GraphPriority.FIRST_AUDIO, GraphPriority.NORMAL, GraphPriority.LLM


def _drain(order: GraphWorkOrder[str], now: float = 0.0) -> list[str]:
    out = []
    while (item := order.pop(now)) is not None:
        out.append(item)
    return out


def test_without_holds_first_audio_work_goes_first_and_the_rest_keeps_its_order() -> None:
    order: GraphWorkOrder[str] = GraphWorkOrder()
    for item, prio in (("llm-a1", LLM), ("flow-b1", FIRST), ("flow-c5", NORMAL), ("llm-a2", LLM),
                       ("flow-b2", FIRST), ("llm-c1", LLM)):
        order.push(item, prio)
    assert order.pending(LLM) == 3 and order.pending(FIRST) == 2 and order.pending_rest == 4
    assert _drain(order) == ["flow-b1", "flow-b2", "llm-a1", "flow-c5", "llm-a2", "llm-c1"]
    assert len(order) == 0
    stats = order.stats.as_dict()
    assert stats["runs"] == {"first_audio": 2, "normal": 1, "llm": 3}
    assert stats["overtaken"] == 2 and stats["deferred"] == 1 and stats["forced"] == 0


def test_an_open_hold_keeps_llm_work_waiting_even_when_nothing_else_is_queued() -> None:
    order: GraphWorkOrder[str] = GraphWorkOrder(hold_max_s=10.0)
    hold = order.open_hold(now=0.0)
    order.push("llm-next-chunk", LLM)
    assert order.pop(now=1.0) is None  # the first chunk's next window is about to come
    order.push("flow-window-2", FIRST)
    order.push("flow-of-a-speaking-stream", NORMAL)  # not held: that stream must not stutter
    assert order.pop(now=1.1) == "flow-window-2"
    assert order.pop(now=1.1) == "flow-of-a-speaking-stream"
    assert order.pop(now=1.2) is None
    assert order.wake_in(now=1.2) == pytest.approx(8.8)  # when the hold stops blocking
    order.close_hold(hold, now=2.0)
    assert order.pop(now=2.0) == "llm-next-chunk"
    stats = order.stats.as_dict()
    assert stats["holds"] == 1 and stats["held_ms"] == 2000.0 and stats["deferred"] == 1
    assert stats["expired"] == 0 and stats["overtaken"] == 2
    # closing (engine shutdown) drains the LLM work whatever the holds
    order.open_hold(now=3.0)
    order.push("llm-last", LLM)
    assert order.pop(now=3.0) is None and order.pop(now=3.0, drain=True) == "llm-last"


def test_held_llm_work_let_go_runs_in_its_turn_among_the_rest() -> None:
    """release_llm (a new stream waits for the round a held step blocks): the LLM items queued then run
    as NORMAL work, in their order among the rest and behind first-audio work; LLM work queued later is
    held again."""
    order: GraphWorkOrder[str] = GraphWorkOrder(hold_max_s=10.0)
    order.open_hold(now=0.0)
    order.push("llm-step-1", LLM)
    order.push("flow-of-a-speaking-stream", NORMAL)
    assert order.pop(now=0.1) == "flow-of-a-speaking-stream" and order.pop(now=0.1) is None
    order.push("flow-window", FIRST)
    assert order.release_llm() == 1 and order.pending(LLM) == 0 and order.pending(NORMAL) == 1
    order.push("llm-step-2", LLM)
    assert _drain(order, now=0.2) == ["flow-window", "llm-step-1"]  # step 2 is held again
    assert order.pending(LLM) == 1 and order.release_llm() == 1 and order.release_llm() == 0
    assert order.pop(now=0.3) == "llm-step-2"
    stats = order.stats.as_dict()
    assert stats["released"] == 2 and stats["runs"] == {"first_audio": 1, "normal": 3, "llm": 0}


def test_a_hold_blocks_only_until_it_is_hold_max_s_old() -> None:
    order: GraphWorkOrder[str] = GraphWorkOrder(hold_max_s=1.5)
    first = order.open_hold(now=0.0)
    second = order.open_hold(now=1.0)  # a second stream's first chunk: the holds overlap
    order.push("llm", LLM)
    assert order.pop(now=1.4) is None
    assert order.pop(now=2.0) is None  # the first hold expired, the second still blocks
    assert order.wake_in(now=2.0) == pytest.approx(0.5)
    assert order.pop(now=2.6) == "llm"
    order.close_hold(first, now=2.7)
    order.close_hold(second, now=2.8)
    order.close_hold(second, now=2.9)  # twice: ignored
    stats = order.stats.as_dict()
    assert stats["expired"] == 2 and stats["held_ms"] == 2800.0 and order.open_holds == 0


def test_llm_work_is_overtaken_at_most_max_overtakes_times() -> None:
    order: GraphWorkOrder[str] = GraphWorkOrder(hold_max_s=100.0, max_overtakes=2)
    order.open_hold(now=0.0)
    order.push("llm-1", LLM)
    order.push("llm-2", LLM)
    for i in range(5):
        order.push(f"flow-{i}", FIRST)
    # each LLM item, once the oldest, lets two items by, then runs
    assert _drain(order) == ["flow-0", "flow-1", "llm-1", "flow-2", "flow-3", "llm-2", "flow-4"]
    assert order.stats.forced == 2 and order.stats.overtaken == 4
    # NORMAL work that jumped a held LLM item counts too; when it is let go, the rest keeps its order
    order.push("flow-a", NORMAL)
    order.push("llm-3", LLM)
    order.push("flow-b", NORMAL)
    order.push("flow-c", NORMAL)
    order.push("flow-d", NORMAL)
    assert _drain(order) == ["flow-a", "flow-b", "flow-c", "llm-3", "flow-d"]
    assert order.stats.forced == 3


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="hold_max_s"):
        GraphWorkOrder(hold_max_s=0)
    with pytest.raises(ValueError, match="max_overtakes"):
        GraphWorkOrder(max_overtakes=-1)


# --- on the worker --------------------------------------------------------------------------
def test_the_graph_thread_runs_first_audio_work_first_and_holds_the_rest() -> None:
    ran: list[str] = []
    with GraphThread(hold_max_s=3600.0) as worker:
        gate = threading.Event()
        blocked = worker.submit(gate.wait)  # the worker is busy: what follows queues
        normal = [worker.submit(lambda i=i: ran.append(f"llm-{i}"), priority=LLM) for i in range(3)]
        with worker.first_audio():
            assert worker.current_priority() is FIRST
            first = [worker.submit(lambda i=i: ran.append(f"flow-{i}")) for i in range(2)]
            gate.set()
            for f in first:
                f.result(30)
            assert ran == ["flow-0", "flow-1"]
            # the worker is idle, the hold open: the LLM steps still wait ...
            later = worker.submit(lambda: ran.append("flow-2"))
            later.result(30)
            # (untagged work of another stream, NORMAL, does not)
            worker.submit(lambda: ran.append("other-stream"), priority=NORMAL).result(30)
            assert ran == ["flow-0", "flow-1", "flow-2", "other-stream"] and not any(f.done() for f in normal)
        assert worker.current_priority() is NORMAL
        # ... and run, in their order, once the first audio is out
        for f in normal:
            f.result(30)
        assert blocked.result() is True
        assert ran == ["flow-0", "flow-1", "flow-2", "other-stream", "llm-0", "llm-1", "llm-2"]
        stats = worker.order_stats()
    assert stats["runs"] == {"first_audio": 3, "normal": 2, "llm": 3} and stats["holds"] == 1
    assert stats["deferred"] == 1 and stats["forced"] == 0


def test_a_hold_on_another_thread_does_not_raise_that_threads_priority_and_close_drains() -> None:
    ran: list[str] = []
    worker = GraphThread(max_pending=1, hold_max_s=3600.0).start()
    entered, leave = threading.Event(), threading.Event()

    def holder() -> None:
        with worker.first_audio():
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    entered.wait(30)
    assert worker.current_priority() is NORMAL  # this thread is not in the hold
    queued = worker.submit(lambda: ran.append("llm"), priority=LLM)
    # FIRST_AUDIO work is admitted beyond max_pending (the holds bound it)
    urgent = worker.submit(lambda: ran.append("flow"), priority=FIRST)
    urgent.result(30)
    assert not queued.done()
    worker.close()  # runs what is queued, hold or not
    assert queued.done() and ran == ["flow", "llm"]
    leave.set()
    t.join(30)
