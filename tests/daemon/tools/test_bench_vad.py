"""The idle-CPU benchmark runs (its number is reported, not asserted: -m bench)."""

from __future__ import annotations

import json

import pytest
from cosyedge_daemon.tools.bench_vad import main


@pytest.mark.bench
def test_idle_capture_vad_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seconds", "20"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    print(result)
    assert result["frames"] >= 0.95 * result["frames_expected"]  # it really ran in real time


def test_bench_runs_briefly_on_a_paced_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seconds", "1", "--source", "paced"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["source"] == "paced" and result["frames"] >= 25 and result["dropped"] == 0
    assert 0 <= result["cpu_percent_of_one_core"] < 100
