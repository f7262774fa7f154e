"""A compact text rendering of a request's stage timeline (cosyedge_models.synthesis.api.StageEvent):
one row per stage, time left to right, each cell showing the chunk (index mod
10) that the stage worked on then, so that overlap between the LLM and the
flow / vocoder of earlier chunks is visible at a glance in `cosyedge bench`; and a bench level's
graph-thread trace (models/backends/profiling.py) the same way, one row per kind of work."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from cosyedge_models.backends.profiling import trace_items
from cosyedge_models.synthesis.api import StageEvent

ROWS = ("llm", "flow", "vocoder", "hold")  # hold: the first-audio hold on the GPU graph thread


def render_timeline(events: Sequence[StageEvent], width: int = 100) -> str:
    if not events:
        return "timeline: no events"
    end = max(e.end_ms for e in events)
    scale = max(end / width, 1e-3)  # ms per column
    rows = {stage: [" "] * width for stage in ROWS}
    for e in sorted(events, key=lambda e: e.start_ms):
        row = rows.get(e.stage)
        if row is None:
            continue
        first = min(int(e.start_ms / scale), width - 1)
        last = max(first + 1, math.ceil(e.end_ms / scale))  # every event gets at least one cell
        for col in range(first, min(last, width)):
            row[col] = str(e.chunk % 10)
    label = max(len(s) for s in ROWS)
    lines = [f"timeline: 0 to {end:.0f} ms, one column = {scale:.1f} ms, digits = chunk index (mod 10)"]
    lines += [f"{stage:<{label}} |{''.join(cells)}|" for stage, cells in rows.items()]
    return "\n".join(lines)


def render_graph_trace(trace: Mapping[str, Any], width: int = 100, until_ms: float | None = None) -> str:
    """A bench level's graph-thread trace (GraphTrace.as_dict) as text: one row per label, time left to
    right from the level's start to `until_ms` (default: the last item's end); a cell is '#' where that
    label's items fill at least half of it, '+' where they fill some of it, and the last row shows the
    cells where no item ran ('.')."""
    items = trace_items(trace)
    if not items:
        return "graph trace: no items"
    end = until_ms if until_ms is not None else max(i.ended_s for i in items) * 1e3
    scale = max(end / width, 1e-3)  # ms per column
    filled: dict[str, list[float]] = {}
    for i in items:
        cells = filled.setdefault(i.label, [0.0] * width)
        start, stop = i.started_s * 1e3, min(i.ended_s * 1e3, end)
        for col in range(max(int(start / scale), 0), min(math.ceil(stop / scale), width)):
            cells[col] += max(0.0, min(stop, (col + 1) * scale) - max(start, col * scale))
    label = max(max(len(k) for k in filled), len("idle"))
    lines = [f"graph trace: 0 to {end:.0f} ms, one column = {scale:.1f} ms, {len(items)} items"
             + (f" ({trace['dropped']} past the limit)" if trace.get("dropped") else "")]
    for name, cells in sorted(filled.items()):
        lines.append(f"{name:<{label}} |{''.join('#' if c >= scale / 2 else '+' if c > 0 else ' ' for c in cells)}|")
    idle = ["." if all(cells[col] == 0 for cells in filled.values()) else " " for col in range(width)]
    lines.append(f"{'idle':<{label}} |{''.join(idle)}|")
    return "\n".join(lines)


def render_level_traces(levels: Mapping[str, Mapping[str, Any]], width: int = 100, offline: bool = False) -> str:
    """Each bench level's graph trace (the levels of a `concurrency` or, `offline`, a `concurrency_offline`
    report that have one), titled."""
    kind = " offline" if offline else ""
    return "\n".join(f"concurrency {n}{kind}: {render_graph_trace(level['graph_trace'], width)}"
                     for n, level in levels.items() if "graph_trace" in level)
