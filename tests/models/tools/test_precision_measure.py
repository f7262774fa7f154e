"""`python -m cosyedge_models.tools.precision_measure`: both precisions of one bundle
measured on a backend, recorded in the bundle for the faster-on-CUDA rule
(models/bundle/precision_speed.py). On the CPU here (`ort`); the H200 run records ort-cuda."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cosyedge_build.tools.device_fp16 import fp16_bundle
from cosyedge_models.bundle.precision_speed import PRECISION_SPEED_FILE, auto_precision, faster, read_record
from cosyedge_models.tools.precision_measure import main


def test_measure_and_record(tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = fp16_bundle(tiny_bundle, tmp_path / "b16")
    assert main(["--bundle", str(bundle), "--backend", "ort", "--repeats", "1", "--text", "Hello there."]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert not (bundle / PRECISION_SPEED_FILE).exists()  # without --write nothing is recorded
    for precision in ("fp32", "fp16"):
        assert printed[precision]["rtf"] > 0 and printed[precision]["first_audio_ms"] > 0
    acc = printed["fp16_accuracy"]
    assert acc["mel_nonfinite"] == 0 and acc["mel_snr_db"] > 15 and 0 <= acc["token_agreement"] <= 1
    assert printed["faster"] == faster(printed)

    assert main(["--bundle", str(bundle), "--backend", "ort", "--repeats", "1", "--write"]) == 0
    record = read_record(bundle)["backends"]["ort"]
    assert record["faster"] in ("fp32", "fp16") and record["fp16"]["repeats"] == 1
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert auto_precision(bundle, "ort", manifest) is None  # the rule applies on CUDA only
