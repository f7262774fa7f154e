"""A compact text rendering of a request's stage timeline (cosyedge_models.synthesis.api.StageEvent):
one row per stage, time left to right, each cell showing the chunk (index mod
10) that the stage worked on then, so that overlap between the LLM and the
flow / vocoder of earlier chunks is visible at a glance in `cosyedge bench`."""

from __future__ import annotations

import math
from collections.abc import Sequence

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
