"""Which waiting estimator calls run as the next batched replay (models/batching/flow_order.py):
the highest priority, then the lowest Euler step, a bound on how often a call is passed over,
and when a replay waits for a stream on its way back."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cosyedge_models.backends.graph_thread import GraphPriority
from cosyedge_models.batching.flow_order import (
    Served,
    WaitingCall,
    coming_back,
    next_group,
    single_reason,
    take,
    worth_waiting,
)

N, F = GraphPriority.NORMAL, GraphPriority.FIRST_AUDIO
W = 64  # one window bucket


def _call(group: int, stream: int, priority: GraphPriority = N, window: int = W, passed: int = 0) -> WaitingCall:
    return WaitingCall(group, window, stream, priority, passed)


def test_the_lowest_euler_step_runs_first_and_the_others_count_a_pass() -> None:
    waiting = [_call(5, 1), _call(0, 2), _call(5, 3)]
    assert next_group(waiting, 10) == 0
    assert take(waiting, 0, 8) == [1]
    assert [w.passed for w in waiting] == [1, 0, 1]


def test_the_highest_priority_first_and_its_step_takes_every_priority() -> None:
    waiting = [_call(0, 1), _call(3, 2, F), _call(3, 3), _call(1, 4)]
    assert next_group(waiting, 10) == 3  # a first chunk's step before later chunks' lower steps
    assert take(waiting, 3, 8) == [1, 2]  # the stream at the same step rides along


def test_calls_of_one_step_share_a_replay_whatever_their_windows() -> None:
    waiting = [_call(2, 1, window=128), _call(2, 2), _call(4, 3), _call(2, 4, window=2 * 128)]
    assert next_group(waiting, 10) == 2
    assert take(waiting, 2, 8) == [0, 1, 3]


def test_a_call_passed_over_max_passed_times_runs_next_and_a_batch_is_at_most_the_lanes() -> None:
    waiting = [_call(1, 1), _call(7, 2, passed=9), _call(4, 3, F, passed=10), _call(7, 4, passed=10)]
    assert next_group(waiting, 10) == 4  # the first of the most passed
    assert next_group(waiting, 11) == 4  # none starved: the first chunk's step
    assert next_group(waiting[:2] + waiting[3:], 11) == 1  # none starved: the lowest step
    assert take([_call(2, s) for s in range(5)], 2, 4) == [0, 1, 2, 3]


def test_a_replay_waits_only_for_a_stream_whose_next_call_would_run_or_join() -> None:
    behind = [_call(5, 1)]
    assert worth_waiting(behind, [Served(2, 2, N)], 10)  # back at 3: it runs first (catches up)
    assert worth_waiting(behind, [Served(2, 4, N)], 10)  # back at 5: it joins
    assert not worth_waiting(behind, [Served(2, 6, N)], 10)  # back at 7: ahead, nothing to gain
    assert not worth_waiting([_call(5, 1), _call(3, 2)], [Served(2, 2, N)], 10)  # already back
    assert worth_waiting([_call(2, 1)], [Served(2, 7, F)], 10)  # a first chunk goes first
    first = [_call(5, 1, F)]
    assert not worth_waiting(first, [Served(2, 1, N)], 10)  # a later chunk's step 2 does not hold it
    assert worth_waiting(first, [Served(2, 4, N)], 10)  # ... but may join it
    assert coming_back([_call(3, 1), _call(9, 2)], 10) == [Served(1, 3, N)]  # step 9 of 10 was its last
    # streams a gather released together (FlowBatcher.expect: group -1, their first step next): the first
    # of them to queue waits for the others, and for them before a later step of another stream
    released = [Served(2, -1, N), Served(3, -1, N)]
    assert worth_waiting([_call(0, 1)], released, 10)
    assert worth_waiting([_call(4, 9)], released, 10)
    assert not worth_waiting([_call(0, 1), _call(0, 2), _call(0, 3)], released, 10)  # all there


def _simulate(starts: Sequence[int], pick: Callable[[list[WaitingCall]], int], groups: int = 10,
              lanes: int = 8) -> list[int]:
    """Streams that start one window at the given replay numbers and come straight back for each
    next Euler step (as worth_waiting makes them); the streams each replay served."""
    waiting: list[WaitingCall] = []
    served: list[int] = []
    tick = 0
    while tick <= max(starts) or waiting:
        waiting += [_call(0, s) for s, start in enumerate(starts) if start == tick]
        tick += 1
        if not waiting:
            continue
        batch = [waiting[i] for i in take(waiting, pick(waiting), lanes)]
        for w in batch:
            waiting.remove(w)
        served.append(len(batch))
        waiting += [_call(s.group + 1, s.stream, s.priority) for s in coming_back(batch, groups)]
    return served


def test_streams_out_of_phase_catch_up_and_then_share_every_step() -> None:
    """Four streams starting their windows 3 replays apart: served oldest first (the order before)
    they never meet; lowest step first, each catches up and the last seven steps serve all four."""
    starts = (0, 3, 6, 9)
    ours = _simulate(starts, lambda w: next_group(w, 10) or 0)
    oldest = _simulate(starts, lambda w: w[0].group)
    assert ours == [1] * 12 + [4] * 7 and sum(ours) == 40
    assert max(oldest) == 1 and len(oldest) == 40


def test_a_single_stream_replay_says_what_else_waited() -> None:
    assert single_reason([]) == "alone"
    assert single_reason([_call(5, 2), _call(0, 3, window=2 * W)]) == "other_step"
