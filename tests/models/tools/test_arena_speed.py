"""The CPU-arena speed tool (models/tools/arena_speed.py) and engine_memory's
--cpu-arena run on the tiny bundle and report what they ran with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cosyedge_models.tools import arena_speed, engine_memory


@pytest.mark.parametrize("arena", ["on", "off"])
def test_arena_speed_reports_each_run(tiny_bundle: Path, arena: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert arena_speed.main([str(tiny_bundle), arena, "--runs", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["cpu_memory_arena"] == arena
    assert len(out["offline"]) == len(out["stream"]) == 2
    for run in out["offline"] + out["stream"]:
        assert run["total_s"] > 0 and run["audio_s"] > 0 and run["first_audio_ms"] > 0
    assert out["pss_mb_after"] > 0


def test_engine_memory_records_the_arena(tiny_bundle: Path, tmp_path: Path) -> None:
    report = tmp_path / "memory.json"
    assert engine_memory.main([str(tiny_bundle), "--cpu-arena", "on", "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["cpu_arena"] == "on"
    assert data["after_synthesis"]["pss_bytes"] > 0
