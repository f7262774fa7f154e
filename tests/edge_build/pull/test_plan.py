"""Pure logic of `model pull`: the precision and backend per machine, the disk
and memory estimate and its refusal message."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from cosyedge_build.pull import resources
from cosyedge_build.pull.hub import RepoFile
from cosyedge_build.pull.pipeline import backend_for, choose_precision
from cosyedge_models.errors import CosyEdgeError

GB = 10**9
# the real CosyVoice2-0.5B's files that matter, with their published sizes rounded
FULL = [RepoFile("llm.pt", 2_020 * 10**6), RepoFile("flow.pt", 450 * 10**6), RepoFile("hift.pt", 83 * 10**6),
        RepoFile("campplus.onnx", 28 * 10**6), RepoFile("speech_tokenizer_v2.onnx", 496 * 10**6),
        RepoFile("CosyVoice-BlankEN/model.safetensors", 988 * 10**6), RepoFile("cosyvoice2.yaml", 7_000)]


def test_precision_and_backend_per_machine() -> None:
    assert choose_precision("auto", tensorrt=True, cuda=True) == "int8"
    assert choose_precision("auto", tensorrt=False, cuda=True) == "fp16"
    assert choose_precision("auto", tensorrt=False, cuda=False) == "fp32"
    assert choose_precision("fp16", tensorrt=False, cuda=False) == "fp16"
    with pytest.raises(CosyEdgeError, match="allowed: auto, fp32"):
        choose_precision("int4", tensorrt=False, cuda=False)
    assert backend_for("int8", engines=True, cuda=True) == "trt"
    assert backend_for("fp16", engines=False, cuda=True) == "ort-cuda"
    assert backend_for("int8", engines=False, cuda=True) == "ort"  # Q/DQ int8 is TensorRT's format
    assert backend_for("fp32", engines=False, cuda=False) == "ort"


def test_estimate_counts_only_what_is_left() -> None:
    from cosyedge_build.pull.pipeline import PRECISIONS

    for precision in PRECISIONS:  # every precision the pull accepts has an estimate
        resources.estimate(FULL, precision, engines=False, to_download=0, export_done=False, variant_done=False)
    fresh = resources.estimate(FULL, "int8", engines=True, to_download=4 * GB, export_done=False,
                               variant_done=False)
    fp32 = (2_020 + 450 + 83 + 28 + 496) * 10**6
    assert fresh.parts == {"download": 4 * GB, "fp32 bundle": int(fp32 * 1.1), "int8 variant": int(fp32 * 0.35),
                           "TensorRT engines": int(fp32 * 0.6)}
    weights = (2_020 + 450 + 83 + 988) * 10**6
    assert fresh.memory_bytes == int(resources.BASE_MEMORY + 4.0 * weights)  # the export's peak: ~15 GB
    assert 14 * GB < fresh.memory_bytes < 16.5 * GB
    resumed = resources.estimate(FULL, "int8", engines=False, to_download=0, export_done=True, variant_done=False)
    assert resumed.parts["download"] == 0 and resumed.parts["fp32 bundle"] == 0
    assert resumed.memory_bytes == int(resources.BASE_MEMORY + 3.0 * fp32)


def test_check_says_what_does_not_fit(tmp_path: Path) -> None:
    needs = resources.estimate(FULL, "fp16", engines=False, to_download=4 * GB, export_done=False,
                               variant_done=False)
    resources.check(needs, tmp_path / "new" / "folder", free_disk=needs.disk_bytes, free_memory=needs.memory_bytes)
    with pytest.raises(resources.ResourceError) as err:
        resources.check(needs, tmp_path, free_disk=2**30, free_memory=8 * 2**30)
    text = str(err.value)
    assert f"disk: about {needs.disk_bytes / 2**30:.1f} GiB needed in {tmp_path}" in text and "1.0 GiB free" in text
    assert "download 3.7 GiB" in text and "memory: the build needs about" in text and "8.0 GiB available" in text
    assert "--skip-resource-check" in text and "docs/models.md" in text
    # a folder not made yet: the free space is read from its nearest parent (the real disk, whatever it holds)
    free = shutil.disk_usage(tmp_path).free
    resources.check(dataclasses.replace(needs, disk_bytes=free // 2), tmp_path / "not" / "there", free_memory=None)
    with pytest.raises(resources.ResourceError, match=f"needed in {tmp_path / 'not' / 'there'}"):
        resources.check(dataclasses.replace(needs, disk_bytes=free + 2**40), tmp_path / "not" / "there",
                        free_memory=None)
