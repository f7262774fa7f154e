"""The order in which the GPU graph thread (models/backends/graph_thread.py) runs
its work: "the first chunk first".

A streaming request's time to first audio is its first chunk's LLM steps, then
that chunk's flow and vocoder. With the stages overlapped the LLM producer goes
on decoding the next chunk meanwhile, and on the one graph thread its steps
alternate with the first chunk's estimator windows: measured on the H200, about
35 ms of a 143 ms first-chunk "flow" was the next chunk's LLM steps (docs/gpu.md).
Ordering by priority alone does not help: the flow's calls come one at a time
(each waits for the one before), so between two windows the queue holds only
the LLM step, and it runs.

So a request opens a *first-audio hold* around its first chunk's flow and
vocoder: the work it submits there is `FIRST_AUDIO` and runs ahead of `NORMAL`
work (every LLM step, later chunks, streams that already speak), first in,
first out within each class; and while any hold is open, NORMAL work waits even
on an idle worker, until the holds close. Two bounds keep the NORMAL work from
starving:

* a hold blocks for at most `hold_max_s` after it opened (a first chunk that
  takes longer, e.g. on a slow board, lets the others go on as before);
* the oldest NORMAL item is passed over by at most `max_overtakes` FIRST_AUDIO
  items, then runs (new streams arriving back to back cannot hold it forever).

Once a request's first audio is out it opens no hold again: its work is NORMAL,
first in, first out, like everyone else's. Pure logic: the caller passes the
clock in (`now`, seconds), so tests order work without timing."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

ItemT = TypeVar("ItemT")

# Defaults: a full-size first chunk's flow + vocoder is ~150 ms on an H200 (docs/gpu.md) and
# a few times that on a Jetson; past 1.5 s the hold no longer pays for what it delays.
HOLD_MAX_S = 1.5
# an estimator window is ~9 ms on the H200: 64 windows (a first chunk's ten Euler steps of
# ~3-6 windows each) bound an LLM step's wait to about one first chunk
MAX_OVERTAKES = 64


class GraphPriority(enum.IntEnum):
    """A work item's class; lower runs first."""

    FIRST_AUDIO = 0  # a request's work inside its first-audio hold (first chunk's flow and vocoder)
    NORMAL = 1  # everything else: LLM steps, later chunks, warm-up


@dataclass
class OrderStats:
    """What the order did (bench and probe output, logs)."""

    runs: dict[str, int] = field(default_factory=lambda: {p.name.lower(): 0 for p in GraphPriority})
    holds: int = 0  # first-audio holds opened
    deferred: int = 0  # NORMAL items that waited behind FIRST_AUDIO work or a hold (at least once)
    overtaken: int = 0  # times a FIRST_AUDIO item ran before a waiting NORMAL one
    forced: int = 0  # NORMAL items run while a hold was open (the overtake bound)
    expired: int = 0  # holds that outlived hold_max_s
    held_s: float = 0.0  # time with at least one hold open (summed over closed spans)

    def as_dict(self) -> dict[str, object]:
        return {"runs": dict(self.runs), "holds": self.holds, "deferred": self.deferred,
                "overtaken": self.overtaken, "forced": self.forced, "expired": self.expired,
                "held_ms": round(self.held_s * 1e3, 1)}


@dataclass
class _Waiting(Generic[ItemT]):
    item: ItemT
    overtaken: int = 0
    deferred: bool = False


class GraphWorkOrder(Generic[ItemT]):
    """The queued work and the open holds; `pop` says what runs next. Not thread-safe:
    the graph thread guards it with its lock."""

    def __init__(self, hold_max_s: float = HOLD_MAX_S, max_overtakes: int = MAX_OVERTAKES) -> None:
        if hold_max_s <= 0:
            raise ValueError(f"hold_max_s must be > 0, got {hold_max_s}")
        if max_overtakes < 0:
            raise ValueError(f"max_overtakes must be >= 0, got {max_overtakes}")
        self.hold_max_s = hold_max_s
        self.max_overtakes = max_overtakes
        self._queues: dict[GraphPriority, deque[_Waiting[ItemT]]] = {p: deque() for p in GraphPriority}
        self._holds: dict[int, float] = {}  # hold id -> when it opened
        self._next_hold = 0
        self._held_since: float | None = None
        self.stats = OrderStats()

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def pending(self, priority: GraphPriority) -> int:
        return len(self._queues[priority])

    @property
    def open_holds(self) -> int:
        return len(self._holds)

    def push(self, item: ItemT, priority: GraphPriority) -> None:
        self._queues[GraphPriority(priority)].append(_Waiting(item))

    def open_hold(self, now: float) -> int:
        """A request starts its first chunk's flow and vocoder; returns the hold's id."""
        hold = self._next_hold
        self._next_hold += 1
        if not self._holds:
            self._held_since = now
        self._holds[hold] = now
        self.stats.holds += 1
        return hold

    def close_hold(self, hold: int, now: float) -> None:
        """Its first audio is out (or the request ended); unknown ids are ignored."""
        opened = self._holds.pop(hold, None)
        if opened is None:
            return
        if now - opened > self.hold_max_s:
            self.stats.expired += 1
        if not self._holds and self._held_since is not None:
            self.stats.held_s += now - self._held_since
            self._held_since = None

    def blocking(self, now: float) -> bool:
        """True while an open hold (younger than hold_max_s) keeps NORMAL work waiting."""
        return any(now - opened <= self.hold_max_s for opened in self._holds.values())

    def wake_in(self, now: float) -> float | None:
        """Seconds until the youngest blocking hold expires (NORMAL work could run then
        without any other event), or None when nothing is held back."""
        if not self._queues[GraphPriority.NORMAL] or not self._holds:
            return None
        return max(0.0, max(self._holds.values()) + self.hold_max_s - now)

    def pop(self, now: float, drain: bool = False) -> ItemT | None:
        """The item to run now, or None (nothing queued, or only NORMAL work behind a hold).
        `drain`: ignore the holds (the worker is closing)."""
        first, normal = self._queues[GraphPriority.FIRST_AUDIO], self._queues[GraphPriority.NORMAL]
        head = normal[0] if normal else None
        if head is not None and head.overtaken >= self.max_overtakes:  # the starvation bound
            if first or self.blocking(now):
                self.stats.forced += 1
            return self._run(normal, GraphPriority.NORMAL)
        if first:
            if head is not None:
                head.overtaken += 1
                self.stats.overtaken += 1
                self._defer(head)
            return self._run(first, GraphPriority.FIRST_AUDIO)
        if head is None:
            return None
        if drain or not self.blocking(now):
            return self._run(normal, GraphPriority.NORMAL)
        self._defer(head)
        return None

    def _defer(self, waiting: _Waiting[ItemT]) -> None:
        if not waiting.deferred:
            waiting.deferred = True
            self.stats.deferred += 1

    def _run(self, queue: deque[_Waiting[ItemT]], priority: GraphPriority) -> ItemT:
        self.stats.runs[priority.name.lower()] += 1
        return queue.popleft().item
