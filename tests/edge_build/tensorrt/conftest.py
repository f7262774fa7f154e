"""The tiny bundle quantized to fp16 and INT8 (Q/DQ), built once per run and cached like the
tiny bundle (keyed by the build code), for `build engines` at each precision."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import _cached_dir, _code_hash


def _quantized(tiny_bundle: Path, precision: str) -> Path:
    from cosyedge_build.quantize.pipeline import quantize_bundle
    from cosyedge_build.quantize.settings import AccuracyBudget, QuantizeSettings

    # The tiny model's random weights make the accuracy budget meaningless; its structure is what matters here.
    settings = QuantizeSettings(precision=precision, calibration_size=2, held_out_size=1, feeds_per_stage=6,
                                force=True, budget=AccuracyBudget(e2e_match_min=0.0, llm_top1_min=0.0))
    key = _code_hash("edge_build", "models")

    return _cached_dir(f"tiny-{precision}-bundle", key, lambda out: quantize_bundle(tiny_bundle, out, settings))


@pytest.fixture(scope="session")
def precision_bundles(tiny_bundle: Path) -> dict[str, Path]:
    return {"fp32": tiny_bundle, "fp16": _quantized(tiny_bundle, "fp16"), "int8": _quantized(tiny_bundle, "int8")}
