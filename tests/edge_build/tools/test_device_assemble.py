"""A device run's raw JSON from the folders the device tool brought back
(edge_build/tools/device_assemble.py): entries named by their step's file, a later call's file over
an earlier one's, the plan and its status from the logs, traces kept only where asked, the cloud
step's parameters from the plan, and the summary's ratios computed from the levels."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from cosyedge_build.tools import device_assemble

PLAN = ("d setup FP16=0;e bench FP16=0 BENCH_ARGS=--voice+en8 CONCURRENCY=1,8,16;"
        "k cloud FP16=0 JSON_TAG=no_slots CLOUD_PARAMS=LLM_CAPTURED_PREFILL=true+GRAPH_FLOW_OVERFLOW_SLOTS=0")


def _level(rps: float, trace: bool = True) -> dict:
    e = {"requests_per_s": rps, "first_audio_ms_p50": 100.0, "first_audio_ms_p95": 120.0, "stream_rtf_max": 0.4,
         "failed": 0, "llm_handovers": 9, "llm_handed_tokens": 300}
    return {**e, "graph_trace": {"items": [[0, 1, "x"]]}} if trace else e


def _bench(rps1: float) -> dict:
    return {"first_audio_ms": 130.0, "rtf": 0.13, "reference": {"first_audio_ms": 1800.0, "rtf": 0.9},
            "graph_device_used_bytes": {"decode": 4_411_162_624},
            "concurrency": {"1": _level(rps1), "8": _level(4 * rps1)},
            "concurrency_offline": {"8": {**_level(5.0), "rtf": 0.04}}}


def _tgz(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_run_is_assembled_from_its_calls_folders(tmp_path: Path) -> None:
    first, last = tmp_path / "1", tmp_path / "2"
    first.mkdir()
    last.mkdir()
    _tgz(first / "results.tgz", {"e/bench_h200.json": json.dumps(_bench(1.0)).encode(),
                                 "x/bench_h200_batch_goals_levels.json": json.dumps(_bench(2.0)).encode()})
    _tgz(last / "results.tgz", {"e/bench_h200.json": json.dumps(_bench(3.0)).encode()})
    (last / "cloud_h200_no_slots.json").write_text(json.dumps({"levels": [
        {"concurrency": 1, "throughput_rps": 1.2, "first_chunk_ms": {"p50": 145.0}, "errors": 0}]}))
    _tgz(last / "logs.tgz", {"./plan": PLAN.encode(), "./status": b"19:48:35 start d setup\n19:57:01 end d rc=0\n",
                             "./e.log": b"ignored"})
    out = tmp_path / "run.json"
    assert device_assemble.main([str(first), str(last), "--run", "a run", "--device", "H100", "--script", "plan",
                                 "--note", "n1", "--keep-trace", "bench", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["plan"] == PLAN and doc["status"] == ["19:48:35 start d setup", "19:57:01 end d rc=0"]
    assert doc["notes"] == ["n1"] and doc["run"] == "a run"
    assert doc["bench"]["concurrency"]["1"]["requests_per_s"] == 3.0  # the later call's file
    assert "graph_trace" in doc["bench"]["concurrency"]["8"]
    assert "graph_trace" not in doc["batch_goals_levels"]["concurrency"]["8"]
    assert "graph_trace" not in doc["batch_goals_levels"]["concurrency_offline"]["8"]
    assert doc["graph_device_used_gb"]["bench"] == {"decode": 4.41}
    assert doc["cloud_no_slots"]["params"] == "LLM_CAPTURED_PREFILL=true GRAPH_FLOW_OVERFLOW_SLOTS=0"
    lines = device_assemble.summary(doc)
    assert "bench: official 1800.0 ms RTF 0.9; engine 130.0 ms RTF 0.13" in lines
    assert any(line.startswith("bench c=8: 12.0 rps (4.00x)") and "offline RTF 0.04" in line
               and "handovers 9 for 300 tokens" in line for line in lines)
    assert "cloud_no_slots c=1: 1.2 rps, first chunk p50 145.0 ms, errors 0" in lines


@pytest.mark.parametrize(("path", "name"), [("e/bench_h200.json", "bench"), ("n/bench_h200_slots.json", "bench_slots"),
                                            ("x/bench_h200_batch_goals.json", "batch_goals"),
                                            ("c/cloud_h200.json", "cloud"), ("e/fp16_check.json", None)])
def test_entry_names(path: str, name: str | None) -> None:
    assert device_assemble.entry_name(path) == name


def test_no_results_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        device_assemble.main([str(tmp_path), "--run", "r", "--device", "d", "--script", "s"])
