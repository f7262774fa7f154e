"""Where a bench level's first chunks spent the GPU graph threads, from its graph_trace and first-chunk
marks: python -m cosyedge_models.tools.trace_report BENCH.json [--level 8] [--entry bench]

An offline level (`concurrency_offline`, traced since 2026-12-08) has no first chunk: its whole traced
window is one phase (where its aggregate RTF goes: the replays' rows, the idle time).

Each streaming level (of more than one stream) is cut into the phases of its streams' way to first
audio, by the marks bench reports (first_chunk_ms, ms since the request started: the level's requests
start together): the set-up and prefills (to the first token's p50), the first chunk's tokens (to the
last stream's last first-chunk token), its flow (to the last stream's flow end) and its vocoder (to the
last first audio). For each phase: its span, the graph threads' busy ms by kind of work, their idle ms,
and the batched estimator replays by the rows they served (their notes: `rows N, step S, window W`).
That says whether eight streams' first chunks ran as ten replays of eight rows, and what else took the
thread meanwhile (docs/gpu.md, twenty-sixth run)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cosyedge_models.backends.profiling import TraceItem, busy_between, trace_items

ROWS = re.compile(r"rows (\d+)")
FLOW_REPLAY = "flow_batched_replay"


def phases(first_chunk: Mapping[str, Mapping[str, float]]) -> list[tuple[str, float, float]]:
    """(name, start ms, end ms) of a level's way to first audio, from its first_chunk_ms marks."""
    cuts = [("set-up and prefills", 0.0, first_chunk["first_token_ms"]["p50"]),
            ("first chunk's tokens", first_chunk["first_token_ms"]["p50"], first_chunk["llm_end_ms"]["max"]),
            ("first chunk's flow", first_chunk["llm_end_ms"]["max"], first_chunk["flow_end_ms"]["max"]),
            ("first chunk's vocoder", first_chunk["flow_end_ms"]["max"], first_chunk["vocoder_end_ms"]["max"])]
    return [(name, start, max(start, end)) for name, start, end in cuts]


def replay_rows(items: Sequence[TraceItem], start_s: float, end_s: float) -> dict[int, int]:
    """The batched estimator replays that started in [start_s, end_s), by the rows each served."""
    rows: Counter[int] = Counter()
    for i in items:
        match = ROWS.match(i.detail)
        if i.label == FLOW_REPLAY and match and start_s <= i.started_s < end_s:
            rows[int(match.group(1))] += 1
    return dict(sorted(rows.items()))


def level_report(level: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each phase of one level: span, busy ms by label and idle ms, replays by rows (an offline level:
    its traced window, to the last traced item's end)."""
    items = trace_items(level["graph_trace"])
    cuts = (phases(level["first_chunk_ms"]) if "first_chunk_ms" in level else
            [("traced window", 0.0, max((i.ended_s for i in items), default=0.0) * 1e3)])
    out = []
    for name, start, end in cuts:
        out.append({"phase": name, "from_ms": round(start, 1), "to_ms": round(end, 1),
                    "busy_ms": busy_between(items, start / 1e3, end / 1e3),
                    "flow_replays_by_rows": replay_rows(items, start / 1e3, end / 1e3)})
    return out


def render(n: str, report: Sequence[Mapping[str, Any]]) -> str:
    lines = [f"concurrency {n}:"]
    for p in report:
        busy = ", ".join(f"{k} {v:.1f}" for k, v in sorted(p["busy_ms"].items(), key=lambda kv: -kv[1]))
        rows = ", ".join(f"{r} rows x{c}" for r, c in p["flow_replays_by_rows"].items()) or "none"
        lines.append(f"  {p['phase']} ({p['from_ms']:.1f} to {p['to_ms']:.1f} ms): {busy}; flow replays: {rows}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyedge_models.tools.trace_report", description=__doc__)
    parser.add_argument("bench_json", type=Path)
    parser.add_argument("--level", help="only this concurrency level")
    parser.add_argument("--entry", help="a device run's file (docs/benchmarks/*-runN.json): the bench report under "
                                        "this key (bench, batch_goals_levels, ...)")
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.bench_json.read_text())
    except (OSError, ValueError) as exc:
        print(f"trace_report: cannot read {args.bench_json}: {exc}", file=sys.stderr)
        return 2
    if args.entry is not None:
        if not isinstance(report.get(args.entry), dict):
            entries = ", ".join(k for k, v in report.items() if isinstance(v, dict) and "concurrency" in v)
            print(f"trace_report: {args.bench_json} has no bench report '{args.entry}' (it has: {entries or 'none'})",
                  file=sys.stderr)
            return 2
        report = report[args.entry]
    levels = {(key, n): lv for key in ("concurrency", "concurrency_offline") for n, lv in report.get(key, {}).items()
              if "graph_trace" in lv and int(n) > 1 and (args.level in (None, n))}
    if not levels:
        print(f"trace_report: {args.bench_json} has no level of several streams with a graph_trace "
              "(bench --graph-trace-ms, since the twenty-sixth run; offline levels since 2026-12-08)", file=sys.stderr)
        return 1
    print("\n".join(render(n if key == "concurrency" else f"{n} offline", level_report(lv))
                    for (key, n), lv in levels.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
