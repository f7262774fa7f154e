"""What a batched estimator replay cost on a device run's GPU, by the rows it served and its window,
from the graph threads' traces that run recorded, and what that prices a growing hop at:

    python -m cosyedge_models.tools.replay_cost RUN.json [RUN.json ...] [--json OUT.json] [--steps 10]
        [--hop 25] [--grown-hop 50] [--ratio 2] [--lookahead 3]

RUN.json: a device run's file (docs/benchmarks/*-runN.json, device_assemble.py) or one bench report;
every level's `graph_trace` of every entry of every file counts (give runs on like GPUs only; the
replays' notes: `rows N, step S, window W`).
The projection: a stream's later audio of `grown-hop` tokens takes `grown-hop / hop` chunks at a fixed
hop, each `steps` replays of the window that holds (hop + lookahead) x ratio frames, or one chunk of
`steps` replays of the window that holds the grown hop's frames (SynthesisSettings.max_hop_tokens with
hop_scale; docs/gpu.md, "A growing hop's cap"). Medians of the replays measured at that many rows; a
(rows, window) with no replay in the traces is left out."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from cosyedge_models.backends.fixed_shapes import bucket
from cosyedge_models.backends.profiling import trace_items
from cosyedge_models.tools.trace_report import FLOW_REPLAY

REPLAY = re.compile(r"rows (\d+), step \d+, window (\d+)")  # FlowBatcher's note of a replay


def _traces(report: Any) -> Iterator[Mapping[str, Any]]:
    """Every graph_trace under `report` (a run's entries, their levels)."""
    if isinstance(report, Mapping):
        for key, value in report.items():
            if key == "graph_trace" and isinstance(value, Mapping):
                yield value
            else:
                yield from _traces(value)
    elif isinstance(report, list):
        for value in report:
            yield from _traces(value)


def replay_ms(report: Any) -> dict[tuple[int, int], list[float]]:
    """Each batched estimator replay's wall ms in the traces, by (rows, window frames)."""
    out: dict[tuple[int, int], list[float]] = defaultdict(list)
    for trace in _traces(report):
        for item in trace_items(trace):
            match = REPLAY.match(item.detail)
            if item.label == FLOW_REPLAY and match:
                out[(int(match.group(1)), int(match.group(2)))].append((item.ended_s - item.started_s) * 1e3)
    return dict(out)


def projection(costs: Mapping[tuple[int, int], Sequence[float]], steps: int, hop: int, grown_hop: int,
               ratio: int, lookahead: int) -> list[dict[str, Any]]:
    """Per rows measured at both windows: the replay ms of `grown_hop` tokens of later audio at the fixed
    hop and at the grown one (module docstring)."""
    windows = sorted({w for _, w in costs})
    fixed_w, grown_w = (bucket(windows, (h + lookahead) * ratio) for h in (hop, grown_hop))
    if fixed_w is None or grown_w is None:
        return []
    fixed_w, grown_w = windows[fixed_w], windows[grown_w]
    out = []
    for rows in sorted({r for r, _ in costs}):
        if (rows, fixed_w) not in costs or (rows, grown_w) not in costs:
            continue
        a, b = statistics.median(costs[(rows, fixed_w)]), statistics.median(costs[(rows, grown_w)])
        fixed_ms, grown_ms = steps * grown_hop / hop * a, steps * b
        out.append({"rows": rows, "fixed_window": fixed_w, "fixed_replay_ms": round(a, 2),
                    "grown_window": grown_w, "grown_replay_ms": round(b, 2),
                    "fixed_hop_ms": round(fixed_ms, 1), "grown_hop_ms": round(grown_ms, 1),
                    "saved": round(1 - grown_ms / fixed_ms, 3)})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_models.tools.replay_cost", description=__doc__)
    p.add_argument("run_json", type=Path, nargs="+")
    p.add_argument("--json", type=Path, help="also write the costs and the projection here")
    p.add_argument("--steps", type=int, default=10, help="Euler steps a chunk (CosyVoice 2: 10)")
    p.add_argument("--hop", type=int, default=25, help="the fixed hop in speech tokens")
    p.add_argument("--grown-hop", type=int, default=50, help="the grown hop (max_hop_tokens)")
    p.add_argument("--ratio", type=int, default=2, help="mel frames a speech token")
    p.add_argument("--lookahead", type=int, default=3, help="the flow's look-ahead tokens")
    args = p.parse_args(argv)
    try:
        reports = [json.loads(path.read_text()) for path in args.run_json]
    except (OSError, ValueError) as exc:
        print(f"replay_cost: cannot read a run's file: {exc}", file=sys.stderr)
        return 2
    costs = replay_ms(reports)
    if not costs:
        print("replay_cost: no batched estimator replay in a graph_trace of "
              f"{', '.join(map(str, args.run_json))}", file=sys.stderr)
        return 1
    table = [{"rows": r, "window": w, "replays": len(v), "median_ms": round(statistics.median(v), 2),
              "p90_ms": round(v[0] if len(v) == 1 else statistics.quantiles(v, n=10, method="inclusive")[-1], 2)}
             for (r, w), v in sorted(costs.items())]
    proj = projection(costs, args.steps, args.hop, args.grown_hop, args.ratio, args.lookahead)
    for row in table:
        print(f"rows {row['rows']:2d}, window {row['window']:4d}: {row['replays']:4d} replays, "
              f"median {row['median_ms']:.2f} ms, p90 {row['p90_ms']:.2f}")
    for row in proj:
        print(f"rows {row['rows']:2d}: {args.grown_hop} later tokens {row['fixed_hop_ms']:.1f} ms at hop {args.hop} "
              f"(window {row['fixed_window']}), {row['grown_hop_ms']:.1f} at hop {args.grown_hop} "
              f"(window {row['grown_window']}): {row['saved']:.0%} less")
    if args.json is not None:
        args.json.write_text(json.dumps({"what": __doc__.split("\n\n")[0], "sources": [str(f) for f in args.run_json],
                                         "steps": args.steps, "hop": args.hop, "grown_hop": args.grown_hop,
                                         "ratio": args.ratio, "lookahead": args.lookahead,
                                         "replays": table, "projection": proj}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
