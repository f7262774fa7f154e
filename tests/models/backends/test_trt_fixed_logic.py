"""The fixed-shape stages' engines in the manifest and the loader, without
TensorRT (faked manifests, as test_trt_logic.py): `build engines` records
them like the other stages, the loader takes the ones whose plan exists and
whose stage the bundle still lists, a bundle whose engines predate them
loads as before, and a stale one is refused with the rebuild hint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cosyedge_models.backends.engine_meta import check_engines, plan_file_name, write_manifest
from cosyedge_models.bundle.loader import STAGES, STATIC_FLOW_PREFIX, STATIC_VOCODER_PREFIX, load_bundle
from cosyedge_models.errors import BundleError

from tests.models.backends.test_trt_logic import LOCAL, _engines_meta, _write_bundle

FLOW_W = f"{STATIC_FLOW_PREFIX}64"
VOC_F = f"{STATIC_VOCODER_PREFIX}58"


def _with_fixed(root: Path, plans: tuple[str, ...] = (FLOW_W, VOC_F), listed: tuple[str, ...] = (FLOW_W, VOC_F),
                recorded: tuple[str, ...] = (FLOW_W, VOC_F)) -> dict[str, Any]:
    """A bundle with fixed-shape stages `listed` in its manifest, engines `recorded` for
    them and plan files for `plans`."""
    meta = _engines_meta()
    for name in recorded:
        meta["stages"][name] = {"file": plan_file_name(name, "fp32"), "sha256": "p" + name, "onnx": f"{name}.onnx",
                                "onnx_sha256": "o" + name, "precision": "fp32",
                                "profiles": [{"x": [[2, 80, 64], [2, 80, 64], [2, 80, 64]]}]}
    manifest = _write_bundle(root, meta)
    for name in listed:
        (root / f"{name}.onnx").write_bytes(b"onnx")
        manifest["stages"][name] = {"file": f"{name}.onnx", "sha256": "o" + name, "precision": "fp32",
                                    "profile": {}}
    for name in plans:
        (root / plan_file_name(name, "fp32")).write_bytes(b"plan")
    write_manifest(root, manifest)
    return manifest


def test_the_loader_takes_the_fixed_shape_engines(tmp_path: Path) -> None:
    root = tmp_path / "b"
    _with_fixed(root)
    bundle = load_bundle(root, backend="trt", identity=LOCAL)
    assert bundle.stages[FLOW_W].path == root / plan_file_name(FLOW_W, "fp32")
    assert bundle.stages[VOC_F].path.suffix == ".plan" and bundle.stages[VOC_F].sha256 == "p" + VOC_F
    assert set(bundle.stages) == {*STAGES, FLOW_W, VOC_F}
    ort = load_bundle(root)  # onnxruntime takes the ONNX graphs, as before
    assert ort.stages[FLOW_W].path == root / f"{FLOW_W}.onnx"


def test_fixed_shape_engines_are_optional(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _with_fixed(tmp_path / "old", plans=(), recorded=())  # engines built before them
    assert set(load_bundle(tmp_path / "old", backend="trt", identity=LOCAL).stages) == set(STAGES)
    _with_fixed(tmp_path / "noplan", plans=(FLOW_W,))  # the vocoder's plan was deleted
    with caplog.at_level("WARNING"):
        stages = load_bundle(tmp_path / "noplan", backend="trt", identity=LOCAL).stages
    assert FLOW_W in stages and VOC_F not in stages
    assert "hift_static_f58.fp32.plan" in caplog.text and "cosyedge build engines" in caplog.text
    _with_fixed(tmp_path / "dropped", listed=(FLOW_W,))  # re-exported without the vocoder graphs
    assert VOC_F not in load_bundle(tmp_path / "dropped", backend="trt", identity=LOCAL).stages
    # a dynamic stage's plan stays required
    manifest = _with_fixed(tmp_path / "strict")
    (tmp_path / "strict" / plan_file_name("flow_estimator", "fp32")).unlink()
    with pytest.raises(BundleError, match="flow_estimator.fp32.plan is missing"):
        check_engines(manifest, tmp_path / "strict", LOCAL, (STATIC_FLOW_PREFIX, STATIC_VOCODER_PREFIX))


def test_a_stale_fixed_shape_engine_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "b"
    manifest = _with_fixed(root)
    manifest["stages"][FLOW_W]["sha256"] = "re-exported"
    write_manifest(root, manifest)
    with pytest.raises(BundleError, match="re-exported or re-quantized since.*cosyedge build engines"):
        load_bundle(root, backend="trt", identity=LOCAL)
