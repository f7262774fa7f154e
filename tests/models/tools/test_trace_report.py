"""The trace report (models/tools/trace_report.py): a level's graph trace cut into the phases of its
streams' way to first audio, with the batched replays by rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cosyedge_models.backends.profiling import GraphTrace, TraceItem
from cosyedge_models.tools.trace_report import level_report, main


def _level() -> dict[str, object]:
    """Two streams: set-up to 10 ms, tokens to 30, flow to 60 (two replays of two rows, one of one), vocoder
    to 70; times in seconds since the level started."""
    trace = GraphTrace(0.0, 1.0)
    for label, start, end, detail in (("flow_lane_seed", 0.001, 0.005, ""),
                                      ("llm_batched_step", 0.012, 0.014, "rows 2, batch 2"),
                                      ("llm_batched_step", 0.020, 0.022, "rows 2, batch 2"),
                                      ("flow_batched_replay", 0.030, 0.040, "rows 2, step 0, window 64"),
                                      ("flow_batched_replay", 0.040, 0.050, "rows 2, step 1, window 64"),
                                      ("flow_batched_replay", 0.052, 0.058, "rows 1, step 0, window 64"),
                                      ("vocoder_graph", 0.060, 0.064, "rows 2, frames 50")):
        trace.add(TraceItem("cosyedge-cuda-graphs", label, "normal", start, start, end, detail))
    marks = {"first_token_ms": {"p50": 10.0, "max": 11.0}, "llm_end_ms": {"p50": 28.0, "max": 30.0},
             "flow_end_ms": {"p50": 55.0, "max": 60.0}, "vocoder_end_ms": {"p50": 66.0, "max": 70.0}}
    return {"graph_trace": trace.as_dict(), "first_chunk_ms": marks}


def test_each_phase_has_its_busy_work_idle_time_and_replays_by_rows() -> None:
    report = {p["phase"]: p for p in level_report(_level())}
    setup, tokens = report["set-up and prefills"], report["first chunk's tokens"]
    flow, vocoder = report["first chunk's flow"], report["first chunk's vocoder"]
    assert (setup["from_ms"], setup["to_ms"]) == (0.0, 10.0)
    assert setup["busy_ms"] == {"flow_lane_seed": 4.0, "idle": 6.0}
    assert tokens["busy_ms"] == {"llm_batched_step": 4.0, "idle": 16.0}
    assert (flow["from_ms"], flow["to_ms"]) == (30.0, 60.0)
    assert flow["busy_ms"] == {"flow_batched_replay": 26.0, "idle": 4.0}
    assert flow["flow_replays_by_rows"] == {1: 1, 2: 2}
    assert vocoder["busy_ms"] == {"vocoder_graph": 4.0, "idle": 6.0} and vocoder["flow_replays_by_rows"] == {}


def test_the_command_reads_a_bench_json_and_says_what_it_lacks(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"concurrency": {"1": {"requests": 2}, "2": _level()}}))
    assert main([str(bench)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("concurrency 2:")
    assert "first chunk's flow (30.0 to 60.0 ms): flow_batched_replay 26.0, idle 4.0; flow replays: 1 rows x1, " \
           "2 rows x2" in out
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"concurrency": {"2": {"requests": 2}}}))
    assert main([str(old)]) == 1 and "no level of several streams with a graph_trace" in \
        capsys.readouterr().err
    assert main([str(tmp_path / "missing.json")]) == 2 and "cannot read" in capsys.readouterr().err
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"device": "H100", "bench": {"concurrency": {"2": _level()}}}))
    assert main([str(run), "--entry", "bench"]) == 0 and capsys.readouterr().out.startswith("concurrency 2:")
    assert main([str(run), "--entry", "batch_x"]) == 2 and "no bench report 'batch_x' (it has: bench)" in \
        capsys.readouterr().err


def test_an_offline_level_is_one_phase_its_traced_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An offline level has no first-chunk marks: its trace to the last item's end is one phase."""
    level = _level()
    del level["first_chunk_ms"]
    (only,) = level_report(level)
    assert (only["phase"], only["from_ms"], only["to_ms"]) == ("traced window", 0.0, 64.0)
    assert only["busy_ms"] == {"flow_lane_seed": 4.0, "llm_batched_step": 4.0, "flow_batched_replay": 26.0,
                               "vocoder_graph": 4.0, "idle": 26.0}
    assert only["flow_replays_by_rows"] == {1: 1, 2: 2}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"concurrency": {"2": _level()}, "concurrency_offline": {"2": level}}))
    assert main([str(bench)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("concurrency 2:") and "concurrency 2 offline:\n  traced window (0.0 to 64.0 ms)" in out
