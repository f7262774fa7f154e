"""How many streams the GPU flow serves at once: one seat for each batched lane and each
single-stream fixed-shape slot beside them. A stream beyond them used to take the dynamic
estimator graph, whose caches and arena grow on the device with every such stream: on an H100 with
eight lanes and two slots, sixteen streams ran it out of memory (twenty-third run,
docs/benchmarks/h100-2026-12-06-run23.json) and the requests failed. Now such a stream waits for a
seat (a stream ending) before its segment starts, holding nothing on the GPU; past `wait_s` it goes on
without one, as before, with a warning."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

# How long a stream waits for a seat before it takes the dynamic graph anyway: several utterances'
# worth, so that a burst queues instead of failing, and a seat never given back does not stall forever.
SEAT_WAIT_S = 30.0


@dataclass
class SeatStats:
    """What the seats did (bench output, tests)."""

    waits: int = 0  # streams that found every seat taken
    wait_s: float = 0.0  # their time waiting
    unseated: int = 0  # streams that waited `wait_s` in vain and went on without a seat

    def as_dict(self) -> dict[str, object]:
        return {"seat_waits": self.waits, "seat_wait_ms": round(self.wait_s * 1e3, 1), "unseated": self.unseated}


class StreamSeats:
    """`count` seats; `take()` one before a stream's caches are made, `give_back()` when they are
    released. Thread-safe; first come, first seated is not promised (a condition variable wakes any)."""

    def __init__(self, count: int, wait_s: float = SEAT_WAIT_S) -> None:
        if count < 1:
            raise ValueError(f"StreamSeats needs at least one seat, got {count}")
        self.count = count
        self.wait_s = wait_s
        self.stats = SeatStats()
        self._free = count
        self._cond = threading.Condition()

    def take(self) -> bool:
        """A seat (True), waiting up to `wait_s` for one; False: none came, go on without one."""
        with self._cond:
            if self._free == 0:
                t0 = time.perf_counter()
                self.stats.waits += 1
                seated = self._cond.wait_for(lambda: self._free > 0, timeout=self.wait_s)
                self.stats.wait_s += time.perf_counter() - t0
                if not seated:
                    self.stats.unseated += 1
                    log.warning("flow: all %d GPU stream seats taken for %.0f s; this stream goes on without one "
                                "(the dynamic graph, more GPU memory)", self.count, self.wait_s)
                    return False
            self._free -= 1
            return True

    def give_back(self) -> None:
        with self._cond:
            if self._free >= self.count:
                raise RuntimeError("StreamSeats.give_back without a seat taken")
            self._free += 1
            self._cond.notify()

    @property
    def free(self) -> int:
        with self._cond:
            return self._free

    def report(self) -> dict[str, object]:
        with self._cond:
            return {"seats": self.count, **self.stats.as_dict()}
