"""The replay cost tool (models/tools/replay_cost.py): the batched estimator replays of a device run's
traces by rows and window, and the growing hop's projection from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cosyedge_models.backends.profiling import GraphTrace, TraceItem
from cosyedge_models.tools.replay_cost import main, projection, replay_ms


def _trace(replays: list[tuple[int, int, float]]) -> dict[str, object]:
    """(rows, window, ms) replays one after another, and an LLM step and a seed the tool must skip."""
    trace = GraphTrace(0.0, 10.0)
    t = 0.0
    for rows, window, ms in replays:
        trace.add(TraceItem("g", "flow_batched_replay", "normal", t, t, t + ms / 1e3,
                            f"rows {rows}, step 3, window {window}"))
        t += ms / 1e3
    trace.add(TraceItem("g", "llm_batched_step", "llm", t, t, t + 0.002, "rows 8, batch 8"))
    trace.add(TraceItem("g", "flow_batched_replay", "normal", t, t, t, "none (served by an earlier turn)"))
    return trace.as_dict()


def _run() -> dict[str, object]:
    """A run's file: two entries, their levels' traces."""
    one = _trace([(1, 64, 5.0), (1, 64, 6.0), (1, 64, 7.0), (1, 128, 6.0)])
    eight = _trace([(8, 64, 8.0), (8, 128, 10.0), (8, 128, 12.0)])
    return {"plan": "x", "bench": {"concurrency": {"1": {"graph_trace": one}, "8": {"graph_trace": eight}}},
            "batch_x": {"concurrency": {"16": {"graph_trace": _trace([(16, 64, 12.0)])}}}}


def test_replays_by_rows_and_window_from_every_trace() -> None:
    costs = {k: [round(v, 6) for v in vs] for k, vs in replay_ms(_run()).items()}
    assert costs == {(1, 64): [5.0, 6.0, 7.0], (1, 128): [6.0], (8, 64): [8.0], (8, 128): [10.0, 12.0],
                     (16, 64): [12.0]}


def test_the_projection_prices_later_audio_at_both_hops() -> None:
    """Hop 25 with 3 look-ahead tokens at 2 frames a token: windows of 56 frames (bucket 64); hop 50: 106
    (bucket 128). 50 later tokens: two chunks of 10 replays at 64, or one of 10 at 128."""
    rows = {r["rows"]: r for r in projection(replay_ms(_run()), 10, 25, 50, 2, 3)}
    assert set(rows) == {1, 8}  # 16 rows have no replay at 128: left out
    one, eight = rows[1], rows[8]
    assert (one["fixed_window"], one["grown_window"]) == (64, 128)
    assert one["fixed_hop_ms"] == pytest.approx(2 * 10 * 6.0) and one["grown_hop_ms"] == pytest.approx(10 * 6.0)
    assert one["saved"] == pytest.approx(0.5)
    assert eight["fixed_hop_ms"] == pytest.approx(160.0) and eight["grown_hop_ms"] == pytest.approx(110.0)
    assert eight["saved"] == pytest.approx(1 - 110 / 160, abs=1e-3)
    # a grown hop that no measured window holds: nothing to price
    assert projection(replay_ms(_run()), 10, 25, 75, 2, 3) == []


def test_main_writes_the_table_and_says_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_run()))
    out = tmp_path / "cost.json"
    assert main([str(run), str(run), "--json", str(out)]) == 0  # two files: every replay counted twice
    written = json.loads(out.read_text())
    assert {(r["rows"], r["window"]): r["replays"] for r in written["replays"]}[(1, 64)] == 6
    assert [p["rows"] for p in written["projection"]] == [1, 8]
    printed = capsys.readouterr().out
    assert "50 later tokens 120.0 ms at hop 25 (window 64), 60.0 at hop 50 (window 128): 50% less" in printed
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"bench": {"concurrency": {}}}))
    assert main([str(empty)]) == 1
    assert "no batched estimator replay in a graph_trace" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.json")]) == 2
