"""The HTTP overhead benchmark (`python -m cosyedge_daemon.tools.bench_http`), on the
tiny bundle; a benchmark, never in the default run (`pytest -m bench`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cosyedge_daemon.tools.bench_http import measure


@pytest.mark.bench
def test_http_overhead_benchmark_runs(tiny_bundle: Path) -> None:
    report = measure(tiny_bundle, runs=3, warmup=1)
    for result in report["clients"].values():
        assert len(result["runs"]) == 3
        assert result["engine_first_audio"]["median_ms"] > 0
        assert all(r["client_first_byte_ms"] > 0 for r in result["runs"])
    assert report["machine"]
