"""The K/V write variants the scatter benchmark times (edge_build/tools/device_scatter_bench.py) write
the same values on onnxruntime's CPU provider: the window's K/V at frames length..length+W of every
row and head, everything else as it was, the buffers bound in place."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cosyedge_build.tools.device_scatter_bench import VARIANTS, main, run_variant

N, H, F, D, W, AT = 4, 2, 40, 16, 8, 13


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_writes_the_window_at_each_rows_length_in_place(variant: str) -> None:
    _, after = run_variant(variant, "ort", 2, N, H, F, D, W, length=AT, calls=1, seed=5)
    rng = np.random.default_rng(5)
    k = rng.standard_normal((N, W, H, D)).astype(np.float16)
    for cache in after:  # each buffer as the variant declared it, seen as [N, H, F, D]
        before = rng.standard_normal(cache.shape).astype(np.float16).reshape(N, H, F, D)
        got = cache.reshape(N, H, F, D)
        np.testing.assert_array_equal(got[:, :, AT:AT + W], k.transpose(0, 2, 1, 3))
        window = np.s_[AT:AT + W]
        np.testing.assert_array_equal(np.delete(got, window, axis=2), np.delete(before, window, axis=2))


def test_the_benchmark_writes_a_report_per_variant_and_batch(tmp_path: Path) -> None:
    out = tmp_path / "scatter.json"
    assert main(["--backend", "ort", "--streams", "1", "--scatters", "2", "--heads", "2", "--frames", "40",
                 "--dim", "16", "--window", "8", "--length", str(AT), "--calls", "2", "--out", str(out)]) == 0
    reports = json.loads(out.read_text())["scatter_bench"]
    assert [r["variant"] for r in reports] == list(VARIANTS)
    assert all(r["rows"] == 2 and r["scatters"] == 2 and r["run_ms_p50"] > 0 for r in reports)
