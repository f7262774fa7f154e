"""The Wyoming overhead benchmark (`python -m cosyedge_daemon.tools.bench_wyoming`), on
the tiny bundle; a benchmark, never in the default run (`pytest -m bench`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cosyedge_daemon.tools.bench_wyoming import measure


@pytest.mark.bench
def test_wyoming_overhead_benchmark_runs(tiny_bundle: Path) -> None:
    report = measure(tiny_bundle, runs=3, warmup=1)
    for mode in ("synthesize", "streaming"):
        assert len(report[mode]["runs"]) == 3
        assert report[mode]["engine_first_audio"]["median_ms"] > 0
    assert report["machine"]
