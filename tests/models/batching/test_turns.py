"""The queue-and-turn helper the batched flow lanes, encoder windows and vocoder share
(models/batching/turns.py): the calls waiting when a turn runs share its replay, each getting its own
result and the later turns doing nothing; a replay's exception reaches every call of its group; a
submit that raises leaves nothing queued; on the graph thread the turns run inline."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
from cosyedge_models.backends.graph_thread import GraphPriority, GraphThread, GraphThreadClosed
from cosyedge_models.batching.turns import TurnQueue


@dataclass(eq=False)
class _Call:
    value: int
    future: Future[int] = field(default_factory=Future)


class _Owner:
    """An owner of the helper, as the batched stages are: up to `size` of the oldest calls per turn."""

    def __init__(self, thread: GraphThread, size: int = 4, fail: BaseException | None = None,
                 inline: bool = False) -> None:
        self.turns = TurnQueue[_Call](thread, self._serve, "test_turn", inline=inline)
        self.size = size
        self.fail = fail
        self.groups: list[list[int]] = []  # the values each replay served

    def run(self, value: int) -> int:
        call = _Call(value)
        self.turns.queue(call)
        return call.future.result()

    def _serve(self) -> None:
        group = self.turns.take(lambda pending: pending[:self.size])
        self.turns.settle(group, lambda: self._replay(group))

    def _replay(self, group: list[_Call]) -> list[int]:
        self.groups.append([c.value for c in group])
        if self.fail is not None:
            raise self.fail
        return [10 * c.value for c in group]


def _three_waiting(owner: _Owner, thread: GraphThread) -> dict[int, int | BaseException]:
    """Three callers queued while the graph thread is held (one inside first_audio()), then released;
    what each got."""
    got: dict[int, int | BaseException] = {}
    running, gate = threading.Event(), threading.Event()

    def held() -> None:
        running.set()
        gate.wait(10)

    hold = thread.submit(held, label="test_hold")
    assert running.wait(10)  # else a first-audio turn would run ahead of the hold

    def one(value: int) -> None:
        try:
            if value == 1:
                with thread.first_audio():
                    got[value] = owner.run(value)
            else:
                got[value] = owner.run(value)
        except BaseException as exc:  # compared by the test
            got[value] = exc

    callers = [threading.Thread(target=one, args=(v,)) for v in (1, 2, 3)]
    for c in callers:
        c.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (owner.turns.waiting < 3 or thread.pending(GraphPriority.NORMAL) < 2
                                               or thread.pending(GraphPriority.FIRST_AUDIO) < 1):
            time.sleep(0.002)
        # each call submitted its own turn at its caller's priority
        assert owner.turns.waiting == 3
        assert thread.pending(GraphPriority.FIRST_AUDIO) == 1 and thread.pending(GraphPriority.NORMAL) == 2
    finally:
        gate.set()
    hold.result()
    for c in callers:
        c.join(10)
    thread.call(lambda: None)  # after the other two turns
    return got


def test_calls_waiting_together_share_one_turn_and_each_gets_its_result() -> None:
    with GraphThread() as thread:
        owner = _Owner(thread)
        got = _three_waiting(owner, thread)
        busy = thread.order_stats()["busy_ms"]
    assert got == {1: 10, 2: 20, 3: 30}
    assert len(owner.groups) == 1 and sorted(owner.groups[0]) == [1, 2, 3]  # the later turns were no-ops
    assert owner.turns.waiting == 0
    assert isinstance(busy, dict) and "test_turn" in busy


def test_a_group_larger_than_a_turn_takes_the_oldest_first() -> None:
    with GraphThread() as thread:
        owner = _Owner(thread, size=2)
        got = _three_waiting(owner, thread)
    assert got == {1: 10, 2: 20, 3: 30}
    assert [len(g) for g in owner.groups] == [2, 1]
    assert sorted(owner.groups[0] + owner.groups[1]) == [1, 2, 3]


def test_a_failed_replay_reaches_every_call_of_its_group() -> None:
    error = RuntimeError("replay failed")
    with GraphThread() as thread:
        owner = _Owner(thread, fail=error)
        got = _three_waiting(owner, thread)
    assert got == {1: error, 2: error, 3: error} and all(got[v] is error for v in got)
    assert len(owner.groups) == 1 and owner.turns.waiting == 0


@pytest.mark.parametrize("closed", [False, True])
def test_a_submit_that_raises_leaves_nothing_waiting(closed: bool) -> None:
    thread = GraphThread()
    if closed:
        thread.start().close()
    owner = _Owner(thread)
    call = _Call(7)
    with pytest.raises(GraphThreadClosed):
        owner.turns.queue(call)
    assert owner.turns.waiting == 0 and owner.turns.pending == [] and not call.future.done()
    assert owner.groups == []


def test_on_the_graph_thread_the_turns_run_inline_older_calls_first() -> None:
    older = _Call(1)

    def on_thread(owner: _Owner) -> int:
        with owner.turns.lock:
            owner.turns.pending.append(older)  # queued before this call, its turn not yet run
        return owner.run(2)

    with GraphThread() as thread:
        owner = _Owner(thread, size=1, inline=True)
        calls = thread.calls
        assert thread.call(lambda: on_thread(owner)) == 20
        assert thread.calls == calls + 1  # no turn was submitted: a submitted one would wait for this work
    assert older.future.result(0) == 10
    assert owner.groups == [[1], [2]] and owner.turns.waiting == 0
