"""What the backends record for profiling.

onnxruntime's own per-stage trace: with COSYEDGE_ORT_PROFILE=DIR every session writes its trace there
(`python -m cosyedge_models.tools.ort_profile DIR` summarizes them).

The graph threads' trace (GraphTrace): what the GPU graph threads (graph_thread.py) ran during a bench
level, each item's thread, label, priority and its submission, start and end times, for the items that
started in the level's first `window_s`. The threads' per-label sums (OrderStats.busy_s, waited_s) say
how much of each kind of work ran, not in which order: at eight streams on an H100 the eight first
chunks' flow took 146-157 ms where their ten batched replays are ~90 ms (docs/gpu.md, twenty-sixth run),
and the sums cannot say what ran in between. The trace can. Bounded (`limit` items; those past it are
counted as dropped), so a long level costs a fixed amount of memory and JSON; shared by an engine's graph
threads (per stage, several), hence its lock."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILE_ENV = "COSYEDGE_ORT_PROFILE"


def profile_dir() -> Path | None:
    """The directory the sessions profile into (COSYEDGE_ORT_PROFILE), or None: no profiling."""
    value = os.environ.get(PROFILE_ENV, "").strip()
    return Path(value) if value else None


# an item's row in as_dict; detail: what the work noted of itself (GraphThread.note: a replay's rows, Euler step)
FIELDS = ("thread", "label", "priority", "submitted_ms", "started_ms", "ended_ms", "detail")


@dataclass(frozen=True)
class TraceItem:
    """One work item a graph thread ran (times: time.perf_counter() seconds)."""

    thread: str
    label: str
    priority: str
    submitted_s: float
    started_s: float
    ended_s: float
    detail: str = ""


class GraphTrace:
    """The items that started within `window_s` of `since_s` (perf_counter seconds), at most `limit`."""

    def __init__(self, since_s: float, window_s: float, limit: int = 4000) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.since_s = since_s
        self.window_s = window_s
        self.limit = limit
        self.dropped = 0  # items in the window past the limit
        self._items: list[TraceItem] = []
        self._lock = threading.Lock()

    def add(self, item: TraceItem) -> None:
        if not 0.0 <= item.started_s - self.since_s <= self.window_s:
            return
        with self._lock:
            if len(self._items) < self.limit:
                self._items.append(item)
            else:
                self.dropped += 1

    def items(self) -> list[TraceItem]:
        """The recorded items in the order they started."""
        with self._lock:
            return sorted(self._items, key=lambda i: i.started_s)

    def as_dict(self) -> dict[str, object]:
        """JSON: each item a row of FIELDS, times in ms since `since_s`."""
        def ms(t: float) -> float:
            return round((t - self.since_s) * 1e3, 2)

        rows = [[i.thread, i.label, i.priority, ms(i.submitted_s), ms(i.started_s), ms(i.ended_s), i.detail]
                for i in self.items()]
        return {"window_ms": round(self.window_s * 1e3, 1), "fields": list(FIELDS), "items": rows,
                "dropped": self.dropped}


def busy_between(items: Sequence[TraceItem], start_s: float, end_s: float) -> dict[str, float]:
    """Each label's ms on its threads between start_s and end_s (the part of each item inside), and
    `idle` (ms of that span where no item of the busiest thread ran): what the graph threads did while,
    say, the first chunks' flows were on their way."""
    span = max(end_s - start_s, 0.0)
    busy: dict[str, float] = {}
    per_thread: dict[str, float] = {}
    for i in items:
        inside = max(0.0, min(i.ended_s, end_s) - max(i.started_s, start_s))
        if inside > 0:
            busy[i.label] = busy.get(i.label, 0.0) + inside
            per_thread[i.thread] = per_thread.get(i.thread, 0.0) + inside
    out = {label: round(s * 1e3, 2) for label, s in sorted(busy.items())}
    out["idle"] = round(max(span - max(per_thread.values(), default=0.0), 0.0) * 1e3, 2)
    return out


def trace_items(trace: Mapping[str, Any]) -> list[TraceItem]:
    """A GraphTrace.as_dict() (a bench level's graph_trace) back as items, times in seconds since the
    level started."""
    out = []
    for row in trace["items"]:
        r = dict(zip(trace["fields"], row, strict=True))
        out.append(TraceItem(str(r["thread"]), str(r["label"]), str(r["priority"]), float(r["submitted_ms"]) / 1e3,
                             float(r["started_ms"]) / 1e3, float(r["ended_ms"]) / 1e3, str(r.get("detail", ""))))
    return out
