"""device_lane_replay.py on the CPU: each bundle's batched window loaded, every lane holding the
cached frames, replays timed for the stream counts that fit its lanes, the variant (attention,
precision) read from the manifest; the kernel counts and the CUDA provider's graph only on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

from cosyedge_build.tools.device_lane_replay import main

from tests.conftest import BATCH_FLOW_SIZES, STATIC_FLOW_WINDOWS


def test_lane_replay_times_each_variant_for_the_streams_its_lanes_hold(static_flow_bundle: Path,
                                                                       static_flow_fused_fp16_bundle: Path,
                                                                       tmp_path: Path) -> None:
    out = tmp_path / "lanes.json"
    assert main(["--bundle", str(static_flow_bundle), "--bundle", str(static_flow_fused_fp16_bundle),
                 "--backend", "ort", "--streams", "1,2,16", "--window", str(STATIC_FLOW_WINDOWS[0]),
                 "--cached", "100", "--calls", "3", "--out", str(out)]) == 0
    plain, fused = json.loads(out.read_text())["lane_replay"]
    assert (plain["attention"], plain["precision"]) == ("plain", "fp32")
    assert (fused["attention"], fused["precision"]) == ("fused", "fp16")
    for report in (plain, fused):
        assert report["lanes"] == max(BATCH_FLOW_SIZES) == 2
        assert sorted(report["streams"]) == ["1", "2"]  # 16 streams: more than the lanes
        assert all(row["run_ms_p50"] > 0 and row["calls"] == 3 for row in report["streams"].values())
        assert "cuda_ops" not in report and "kernels_per_replay" not in report["streams"]["1"]
        assert "llm_step" not in report  # no fused LLM step in these bundles


def test_the_fused_llm_step_is_timed_for_each_batch_size(every_graph_bundle: Path, tmp_path: Path) -> None:
    """A bundle with the fused batched LLM step: one step of each batch size, every row's cache
    --llm-length positions (kept below the step's positions), timed; kernels only on a GPU."""
    out = tmp_path / "lanes.json"
    assert main(["--bundle", str(every_graph_bundle), "--backend", "ort", "--streams", "1,4",
                 "--window", str(STATIC_FLOW_WINDOWS[0]), "--calls", "3", "--llm-length", "100000",
                 "--out", str(out)]) == 0
    (report,) = json.loads(out.read_text())["lane_replay"]
    assert sorted(report["streams"]) == ["1", "4"]
    llm = report["llm_step"]
    assert llm["kv_dtype"] == "float32" and llm["cache_length"] == llm["positions"] - 1
    assert sorted(llm["batches"], key=int) == ["1", "2", "4"]
    assert all(row["run_ms_p50"] > 0 and row["calls"] == 3 and "kernels_per_replay" not in row
               for row in llm["batches"].values())
