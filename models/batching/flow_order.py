"""Which waiting estimator calls run as the next batched replay (flow_batcher.py), and
whether to wait a moment for a stream on its way back first. Pure logic over plain
records, so the rules are tested without graphs, threads or sleeps.

Calls share a replay at the same Euler step (each step's caches are one group of lanes),
whatever their windows: the replay runs at the largest window among them, the shorter ones
right-padded (masked frames, as a chunk shorter than its bucket always was): a replay is
launch-bound (~1,500 kernels), so a longer window costs far less than a second replay (in the
H200's fourteenth run no replay had calls of two buckets, `mixed_windows` 0: its
single-stream replays were streams a step apart). On the H200 (seventh run, docs/gpu.md) 78 % of the replays
served one stream: with the calls served in arrival order, streams that started their
chunks at different times stay out of phase for good (one at step 7 and one at step 2
alternate and never meet). So the next replay serves:

1. a call passed over by `max_passed` replays (bound: a stream that is ahead waits at
   most that many replays, about one chunk's Euler loop);
2. else, among the calls of the highest priority waiting (a first chunk's are
   FIRST_AUDIO: first audio first, as on the graph thread), the lowest Euler step:
   streams behind catch up with the ones ahead, which wait for them, and from there on
   they share every step;

with every waiting call of that step, up to the lanes (the oldest first). A stream served by the last
replay comes back for its next step within a fraction of a millisecond (it only
updates x): where its next call would be the one to run or would join it, the replay
waits for it (bounded by the caller), else the thread would run the stream ahead alone
in that gap and the two would drift apart again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cosyedge_models.backends.graph_thread import GraphPriority


@dataclass
class WaitingCall:
    """A call waiting for a replay, in arrival order."""

    group: int  # its Euler step's group of lanes: what may share a replay
    window: int  # its window bucket's frames (the replay runs at its calls' largest)
    stream: int
    priority: GraphPriority
    passed: int = 0  # replays that ran while it waited


@dataclass(frozen=True)
class Served:
    """A stream of the last replay, expected back at a later Euler step of the same window."""

    stream: int
    group: int
    priority: GraphPriority


def next_group(waiting: Sequence[WaitingCall], max_passed: int) -> int | None:
    """The Euler step group of the next replay, or None when nothing waits."""
    if not waiting:
        return None
    starved = [w for w in waiting if w.passed >= max_passed]
    if starved:
        return max(starved, key=lambda w: w.passed).group  # the first of the most passed: the oldest
    top = min(w.priority for w in waiting)
    return min(w.group for w in waiting if w.priority is top)


def take(waiting: Sequence[WaitingCall], group: int, lanes: int) -> list[int]:
    """The indices of the calls of `group` (the oldest `lanes`), the next replay's; every
    other call counts a pass."""
    batch = [i for i, w in enumerate(waiting) if w.group == group][:lanes]
    for i, w in enumerate(waiting):
        if i not in batch:
            w.passed += 1
    return batch


def worth_waiting(waiting: Sequence[WaitingCall], served: Sequence[Served], max_passed: int) -> bool:
    """True while a stream of the last replay has not come back and its next call would
    change or join the next replay: of a higher priority than what waits, or at most the
    next replay's Euler step (the step after its last one is the next replay's: it joins;
    earlier: it runs first)."""
    group = next_group(waiting, max_passed)
    if group is None:
        return any(s.stream not in {w.stream for w in waiting} for s in served)
    back = {w.stream for w in waiting}
    top = min(w.priority for w in waiting)
    for s in served:
        if s.stream in back:
            continue
        if s.priority < top or s.group + 1 == group or (s.priority is top and s.group < group):
            return True
    return False


def coming_back(batch: Sequence[WaitingCall], groups: int) -> list[Served]:
    """The streams of a replay that have a next Euler step in this window."""
    return [Served(w.stream, w.group, w.priority) for w in batch if w.group < groups - 1]


def single_reason(left: Sequence[WaitingCall]) -> str:
    """Why a replay served one stream, from the calls left waiting when it ran: "alone" (none) or
    "other_step" (calls at other Euler steps). Reported per level by bench (FlowBatchStats.singles)."""
    return "other_step" if left else "alone"
