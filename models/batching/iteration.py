"""The iteration-level scheduler of the fixed-shape (captured-graph) LLM path,
as pure logic over stream keys and an explicit `now`: no threads, no arrays.
models/batching/graph_batcher.py runs it over a `BatchedDecodeStep`.

A round is: `prefills(now)` (admission, then at most
`max_prefills_between_steps` prefills), the caller prefills those streams and
reports each with `prefilled`; then `batch()` (every running stream, padded to
the next captured batch size), the caller runs that one step and reports each
stream with `stepped`. So:

* a stream joins at the step right after its prefill and leaves after the
  step that finished it (its KV row is free for the next admission);
* a running stream waits for at most `max_prefills_between_steps` prefills
  between two of its steps (the bound on how long a new request's prefill
  stalls the running ones, counted in prefills; the time is that many
  prefills of the longest prompt);
* who is admitted, and when, is the continuous batcher's rule
  (models/batching/policy.py: max_batch_size, preferred sizes, queue delay,
  priority then FIFO), with the running and the admitted-not-yet-prefilled
  streams counted as active;
* rows are handed out lowest first, the batch is in row order: everything is
  deterministic for a given sequence of calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cosyedge_models.batching.batched_step import check_batch_sizes, padded_size
from cosyedge_models.batching.policy import BatchSettings, Waiting, admission_order, admit


@dataclass(frozen=True)
class IterationSettings:
    batch: BatchSettings
    batch_sizes: tuple[int, ...]  # the captured sizes of the step
    rows: int  # KV-cache rows of the step
    max_prefills_between_steps: int = 1

    def __post_init__(self) -> None:
        check_batch_sizes(self.batch_sizes)
        if self.max_prefills_between_steps < 1:
            raise ValueError("max_prefills_between_steps must be >= 1 prefill, "
                             f"got {self.max_prefills_between_steps}")
        limit = min(self.rows, self.batch_sizes[-1])
        if self.batch.max_batch_size > limit:
            raise ValueError(f"max_batch_size {self.batch.max_batch_size} exceeds what the step holds: "
                             f"{self.rows} rows, largest captured batch {self.batch_sizes[-1]}")


@dataclass(frozen=True)
class Prefill:
    key: int
    row: int


@dataclass(frozen=True)
class StepBatch:
    keys: tuple[int, ...]  # in row order
    rows: tuple[int, ...]
    batch_size: int  # the captured size it runs as (>= len(keys))


@dataclass(frozen=True)
class Prefills:
    run: tuple[Prefill, ...]  # prefill these now, in this order
    wake_at: float | None  # waiting streams held back by the queue delay: look again then


class IterationScheduler:
    def __init__(self, settings: IterationSettings) -> None:
        self.settings = settings
        self._waiting: dict[int, Waiting] = {}
        self._admitted: list[Prefill] = []  # hold a row, wait for their prefill (joining order)
        self._running: dict[int, int] = {}  # key -> row
        self._free_rows = list(range(settings.rows))

    # --- arrivals and departures -------------------------------------------------------
    def arrive(self, key: int, now: float, priority: int = 0) -> None:
        if key in self._waiting or key in self._running or any(p.key == key for p in self._admitted):
            raise ValueError(f"stream {key} is already scheduled")
        if len(self._waiting) >= self.settings.batch.max_queue_size:
            raise OverflowError(f"{len(self._waiting)} streams wait to join; max_queue_size is "
                                f"{self.settings.batch.max_queue_size}")
        self._waiting[key] = Waiting(key, priority, now)

    def remove(self, key: int) -> None:
        """The stream leaves wherever it is (finished, cancelled, failed); its row is freed."""
        self._waiting.pop(key, None)
        for p in [p for p in self._admitted if p.key == key]:
            self._admitted.remove(p)
            self._free(p.row)
        row = self._running.pop(key, None)
        if row is not None:
            self._free(row)

    # --- a round -----------------------------------------------------------------------
    def prefills(self, now: float, delay_ms: float | None = None) -> Prefills:
        """Admit what the policy lets in now (each gets a row), then the next
        prefills to run: at most max_prefills_between_steps."""
        active = len(self._running) + len(self._admitted)
        decision = admit(self.settings.batch, list(self._waiting.values()), active, now, delay_ms)
        for w in admission_order(decision.join):
            del self._waiting[w.key]
            self._admitted.append(Prefill(w.key, self._free_rows.pop(0)))
        n = self.settings.max_prefills_between_steps
        return Prefills(tuple(self._admitted[:n]), decision.wake_at)

    def prefilled(self, key: int, finished: bool) -> None:
        """`key`'s prefill ran (and its first token was taken): it joins the next step unless it is done."""
        p = next((p for p in self._admitted if p.key == key), None)
        if p is None:
            raise ValueError(f"stream {key} was not admitted for a prefill")
        self._admitted.remove(p)
        if finished:
            self._free(p.row)
        else:
            self._running[key] = p.row

    def batch(self) -> StepBatch | None:
        """The step over every running stream, or None when none runs."""
        if not self._running:
            return None
        pairs = sorted(self._running.items(), key=lambda kv: kv[1])
        return StepBatch(tuple(k for k, _ in pairs), tuple(r for _, r in pairs),
                         padded_size(len(pairs), self.settings.batch_sizes))

    def stepped(self, key: int, finished: bool) -> None:
        if key not in self._running:
            raise ValueError(f"stream {key} is not running")
        if finished:
            self._free(self._running.pop(key))

    # --- state -------------------------------------------------------------------------
    @property
    def running(self) -> Sequence[int]:
        return list(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def pending_prefills(self) -> int:
        return len(self._admitted)

    def _free(self, row: int) -> None:
        self._free_rows.append(row)
        self._free_rows.sort()
