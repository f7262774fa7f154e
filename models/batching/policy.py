"""Continuous-batching settings and the admission rule: which waiting
requests join the running LLM batch at the next step boundary. Pure logic
over an explicit `now`, so the rules are tested without threads or sleeps.

The knobs are Triton's dynamic-batcher ones, applied at every decode step
(requests join a running batch, not only an idle one):

* `max_batch_size`: batch rows (active requests) at most.
* `preferred_batch_sizes`: batch sizes worth joining for at once. When the
  waiting requests can bring the batch to a preferred size (or to
  `max_batch_size`), the largest such group joins now.
* `max_queue_delay_ms`: otherwise a request waits at most this long for more
  requests to arrive; then everything that fits joins. 0 joins at once.

Scarce slots go to higher priority first, FIFO within a priority."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSettings:
    max_batch_size: int = 4
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_ms: float = 0.0
    max_queue_size: int = 64  # requests waiting to join; beyond it submit fails (busy)
    # Drop shared leading padding once it is this many columns (models/batching/slots.py).
    compact_min_columns: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_size <= 256:
            raise ValueError(f"max_batch_size must be between 1 and 256 requests, got {self.max_batch_size}")
        bad = [s for s in self.preferred_batch_sizes if not 1 <= s <= self.max_batch_size]
        if bad:
            raise ValueError(f"preferred_batch_sizes must lie in 1..max_batch_size ({self.max_batch_size}), "
                             f"got {list(bad)}")
        if not 0.0 <= self.max_queue_delay_ms <= 10_000.0:
            raise ValueError(f"max_queue_delay_ms must be between 0 and 10000 ms, got {self.max_queue_delay_ms}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1 request, got {self.max_queue_size}")
        if self.compact_min_columns < 1:
            raise ValueError(f"compact_min_columns must be >= 1 cache position, got {self.compact_min_columns}")


@dataclass(frozen=True)
class Waiting:
    """What the policy needs to know about one waiting request."""

    key: int  # submission order (FIFO tie-break)
    priority: int
    arrived: float  # clock seconds


@dataclass(frozen=True)
class Admission:
    join: list[Waiting]  # in joining order
    wake_at: float | None  # when requests are left waiting for the delay: look again then


def admission_order(waiting: Sequence[Waiting]) -> list[Waiting]:
    return sorted(waiting, key=lambda w: (-w.priority, w.key))


def admit(settings: BatchSettings, waiting: Sequence[Waiting], active: int, now: float,
          delay_ms: float | None = None) -> Admission:
    """The requests that join now. `delay_ms` overrides the setting (the
    engine cuts the delay under load)."""
    free = settings.max_batch_size - active
    if not waiting or free <= 0:
        # Full: a slot frees at a step boundary, when the worker asks again.
        return Admission([], None)
    order = admission_order(waiting)
    avail = min(free, len(order))
    targets = [s for s in (*settings.preferred_batch_sizes, settings.max_batch_size) if active < s <= active + avail]
    if targets:
        return Admission(order[:max(targets) - active], None)
    delay_s = (settings.max_queue_delay_ms if delay_ms is None else delay_ms) / 1e3
    deadline = min(w.arrived for w in waiting) + delay_s
    if now >= deadline:
        return Admission(order[:avail], None)
    return Admission([], deadline)
