"""The sampling benchmark's tool (models/tools/sampling_bench.py) at a size that fits CI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cosyedge_models.tools import sampling_bench


def test_it_times_both_ways_for_each_batch_size(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    assert sampling_bench.main(["--rows", "1,3", "--steps", "3", "--runs", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert sorted(data["results"]) == ["flat_b1", "flat_b3", "peaked_b1", "peaked_b3"]
    for entry in data["results"].values():
        assert len(entry["row_by_row_runs_us"]) == len(entry["together_runs_us"]) == 2
        assert entry["row_by_row_us_per_step"] > 0 and entry["together_us_per_step"] > 0


def test_it_refuses_an_empty_batch() -> None:
    with pytest.raises(SystemExit):
        sampling_bench.main(["--rows", "0"])
