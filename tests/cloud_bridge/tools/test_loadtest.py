"""The load test through the whole chain (a device-side client, the broker,
the bridge, Triton with the tiny bundle). A benchmark: not in the default
run (`pytest -m bench tests/cloud_bridge/tools/test_loadtest.py -s`)."""

from __future__ import annotations

import math

import pytest
from cosyedge_cloud.tools.loadtest import percentiles, run, table

from tests.cloud_bridge.conftest import bridge_settings


def test_percentiles_nearest_rank() -> None:
    assert percentiles([5.0, 1.0, 3.0, 2.0, 4.0]) == {"p50": 3.0, "p90": 5.0, "p99": 5.0}
    assert math.isnan(percentiles([])["p50"])


@pytest.mark.bench
def test_load_levels_and_dynamic_batching(broker, make_bridge, triton) -> None:  # type: ignore[no-untyped-def]
    settings = bridge_settings(broker, triton)
    assert settings.triton.url == triton.grpc_url
    make_bridge(
        triton={"model": "cosyvoice2", "first_chunk_timeout_s": 120.0, "chunk_timeout_s": 120.0},
        limits={"max_in_flight": 16, "max_queued": 64},
    )
    results = run(broker.url, triton.metrics_url, levels=(1, 2, 4, 8, 16), rounds=2)
    print("\n" + table(results))
    assert [r.concurrency for r in results] == [1, 2, 4, 8, 16]
    assert all(r.errors == 0 and r.requests == max(4, 2 * r.concurrency) for r in results)
    assert all(r.first_chunk_ms["p50"] <= r.total_ms["p50"] for r in results)
    # concurrent requests were batched by Triton's dynamic batcher
    assert max(r.avg_batch for r in results if r.concurrency >= 4) > 1.0


def test_model_parameters_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from cosyedge_cloud.tools.loadtest import _parameter, main

    parser = argparse.ArgumentParser()
    assert _parameter(parser, " GRAPH_ENCODER_BATCH = true ") == ("GRAPH_ENCODER_BATCH", "true")
    assert _parameter(parser, "BUNDLE_DIR=") == ("BUNDLE_DIR", "")  # an empty value is a value
    with pytest.raises(SystemExit) as exc:  # refused before any server starts
        main(["--bundle", "/nonexistent", "--parameter", "GRAPH_ENCODER_BATCH"])
    assert exc.value.code == 2
    assert "--parameter takes KEY=VALUE, got 'GRAPH_ENCODER_BATCH'" in capsys.readouterr().err
