"""Which delivered requests the bridge takes: a cap on requests held (in
flight plus queued), and de-duplication of QoS 1 redeliveries by
(device, request id), both while a request runs and for a window of recently
finished ones. Pure logic with a lock; the bridge asks, then acts."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Verdict(Enum):
    ACCEPT = "accept"
    DUPLICATE_RUNNING = "duplicate_running"  # the same request is being served: ack it with that one
    DUPLICATE_DONE = "duplicate_done"  # a redelivery of one answered already: just acknowledge
    FULL = "full"  # at the cap
    DRAINING = "draining"  # shutting down: no new work


Key = tuple[str, str]  # (device id, request id)


@dataclass
class _Held:
    tags: list[Any] = field(default_factory=list)  # the deliveries to acknowledge when done


class Admission:
    def __init__(self, capacity: int, dedupe_max_ids: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.dedupe_max_ids = dedupe_max_ids
        self._lock = threading.Lock()
        self._held: dict[Key, _Held] = {}
        self._done: OrderedDict[Key, None] = OrderedDict()
        self._draining = False
        self._idle = threading.Condition(self._lock)

    def offer(self, key: Key, tag: Any, redelivery: bool = False) -> Verdict:
        """`redelivery`: the MQTT DUP flag. A finished request is dropped only
        when redelivered (its acknowledgement was lost); the same id published
        anew (a device retrying after a retryable error) is a new request."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held.tags.append(tag)
                return Verdict.DUPLICATE_RUNNING
            if key in self._done:
                if redelivery:
                    self._done.move_to_end(key)
                    return Verdict.DUPLICATE_DONE
                del self._done[key]
            if self._draining:
                return Verdict.DRAINING
            if len(self._held) >= self.capacity:
                return Verdict.FULL
            self._held[key] = _Held([tag])
            return Verdict.ACCEPT

    def finish(self, key: Key) -> list[Any]:
        """Forget a held request; returns the delivery tags to acknowledge."""
        with self._lock:
            held = self._held.pop(key, None)
            if self.dedupe_max_ids > 0:
                self._done[key] = None
                while len(self._done) > self.dedupe_max_ids:
                    self._done.popitem(last=False)
            self._idle.notify_all()
            return held.tags if held else []

    def start_draining(self) -> None:
        with self._lock:
            self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until nothing is held; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._held, timeout=timeout_s)
