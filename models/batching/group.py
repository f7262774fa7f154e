"""A group of requests that arrive together (a Triton dynamic batch handed to
one `execute`) and should start decoding together: while a group is open,
the LLM batcher admits none of the waiting requests until every member of
the group has either submitted its LLM request or ended without one (a bad
request fails in the text front end), or until the group's timeout passes.
Then all of them join at the same step boundary, so the group is served as
one batch rather than as requests trickling in one step apart.

Pure logic over an explicit `now`: the batcher asks `blocks(waiting, now)`
at every round; the caller counts members that end (`ended`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass
class RequestGroup:
    size: int  # members expected to submit
    deadline: float  # clock seconds: after it the group no longer holds anyone back
    on_end: Callable[[], None] | None = None  # wakes the batcher: the release may be due
    _ended: int = 0
    _released: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a request group needs at least 1 member, got {self.size}")

    def ended(self) -> None:
        """A member finished (or failed). Before the release, one that ended had
        not submitted (nothing joins while the group holds): expect one fewer."""
        with self._lock:
            if not self._released:
                self._ended += 1
        if self.on_end is not None:
            self.on_end()

    def release(self) -> None:
        with self._lock:
            self._released = True

    def blocks(self, waiting: int, now: float) -> bool:
        """Whether admission must still wait for members, given how many
        requests wait to join. Once it stops blocking it never blocks again."""
        with self._lock:
            if not self._released and (waiting + self._ended >= self.size or now >= self.deadline):
                self._released = True
            return not self._released


@runtime_checkable
class GroupedSynthesizer(Protocol):
    """A synthesizer that can start a group of concurrent requests together
    (CosyVoiceSynthesizer; None from the context when its LLM is unbatched)."""

    def request_group(self, size: int, timeout_s: float) -> AbstractContextManager[RequestGroup | None]: ...


class GroupGate:
    """The open groups of one batcher (its worker asks `holding` every round)."""

    def __init__(self, clock: Callable[[], float], kick: Callable[[], None]) -> None:
        self._clock = clock
        self._kick = kick
        self._lock = threading.Lock()
        self._groups: list[RequestGroup] = []

    @contextmanager
    def group(self, size: int, timeout_s: float) -> Iterator[RequestGroup]:
        """`size` requests about to be submitted from other threads join the
        batch at one step boundary (at the latest after `timeout_s`). Call
        `ended()` on the group when a member finishes, whatever the outcome."""
        members = RequestGroup(size=size, deadline=self._clock() + timeout_s, on_end=self._kick)
        with self._lock:
            self._groups.append(members)
        try:
            yield members
        finally:
            members.release()
            with self._lock:
                self._groups.remove(members)
            self._kick()

    def holding(self, waiting: int, now: float) -> float | None:
        """The earliest deadline of the groups that still hold admission back, None when none does."""
        with self._lock:
            deadlines = [g.deadline for g in self._groups if g.blocks(waiting, now)]
        return min(deadlines) if deadlines else None
