"""device_fp16.py --lanes-only: a linked copy of a bundle whose batched estimator graphs are the
fp16 conversion `build export --batch-flow-precision fp16` writes (K/V I/O float16 in the graph
and the manifest, hashes of the new files), the source bundle untouched; BatchFlowGraphs then
runs fp16 lanes over it with the fp16 export's numbers. device_lanes.py: the same with the batched
graphs exported again from the checkpoint (here with onnxruntime's MultiHeadAttention), equal to
what `build export --batch-flow-attention fused` writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from cosyedge_build.tools import device_lanes
from cosyedge_build.tools.device_fp16 import main
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.ort_cache import DeviceCopier
from cosyedge_models.batching.batched_flow import BatchFlowGraphs, SlotCall, batch_flow_sessions
from cosyedge_models.bundle.loader import BATCH_FLOW_NAME, load_bundle, sha256_file

from tests.conftest import STATIC_FLOW_WINDOWS
from tests.models.batching.test_batched_flow import _feeds


def _run(root: Path, feeds: dict[str, np.ndarray], commit: int) -> tuple[np.ndarray, type]:
    backend = create_backend("ort")
    sessions = batch_flow_sessions(load_bundle(root), lambda name, path: backend.load(name, path, threads=1))
    graphs = BatchFlowGraphs(sessions, ("cpu", 0), DeviceCopier("cpu"))
    graphs.reset(0)
    out = graphs.run([SlotCall(0, feeds, commit)])[0]
    for s in sessions.values():
        s.close()
    return out, graphs.kv_dtype


def test_lanes_only_converts_the_batched_graphs_of_a_linked_copy(static_flow_bundle: Path,
                                                                  static_flow_fp16_bundle: Path,
                                                                  tmp_path: Path) -> None:
    before = (static_flow_bundle / "manifest.json").read_text()
    stages = {n: e for n, e in json.loads(before)["stages"].items() if BATCH_FLOW_NAME.match(n)}
    hashes = {n: sha256_file(static_flow_bundle / e["file"]) for n, e in stages.items()}
    dst = tmp_path / "lanes16"
    assert main(["--bundle", str(static_flow_bundle), "--out", str(dst), "--lanes-only"]) == 0

    manifest = json.loads((dst / "manifest.json").read_text())
    for name in stages:
        entry = manifest["stages"][name]
        assert entry["precision"] == "fp16" and entry["sha256"] == sha256_file(dst / entry["file"])
        kv = [s["dtype"] for s in (*entry["inputs"], *entry["outputs"]) if s["name"].startswith("key_cache_")]
        assert kv and set(kv) == {"float16"}
        assert {s["dtype"] for s in entry["inputs"] if s["name"] == "x"} == {"float32"}
    # the source keeps its fp32 graphs and manifest; the rest of the copy is the source's
    assert (static_flow_bundle / "manifest.json").read_text() == before
    assert {n: sha256_file(static_flow_bundle / e["file"]) for n, e in stages.items()} == hashes
    assert manifest["stages"]["flow_estimator"] == json.loads(before)["stages"]["flow_estimator"]

    rng = np.random.default_rng(3)
    w = STATIC_FLOW_WINDOWS[0]
    entry = stages[f"flow_estimator_batch_b1_w{w}"]
    channels = int(next(s["shape"][1] for s in entry["inputs"] if s["name"] == "x"))
    feeds = _feeds(rng, channels, w)
    out, dtype = _run(dst, feeds, 8)
    ref, ref_dtype = _run(static_flow_fp16_bundle, feeds, 8)
    assert dtype is ref_dtype is np.float16
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-6 * float(np.abs(ref).max()))


def test_device_lanes_exports_the_fused_lanes_into_a_linked_copy(static_flow_bundle: Path, tiny_model_dir: Path,
                                                                 static_flow_fused_fp16_bundle: Path,
                                                                 tmp_path: Path) -> None:
    before = (static_flow_bundle / "manifest.json").read_text()
    stages = [n for n in json.loads(before)["stages"] if BATCH_FLOW_NAME.match(n)]
    dst = tmp_path / "lanesf"
    assert device_lanes.main(["--bundle", str(static_flow_bundle), "--model-dir", str(tiny_model_dir),
                              "--out", str(dst), "--precision", "fp16", "--attention", "fused"]) == 0
    manifest = json.loads((dst / "manifest.json").read_text())
    for name in stages:
        entry = manifest["stages"][name]
        assert (entry["attention"], entry["precision"]) == ("fused", "fp16")
        assert entry["sha256"] == sha256_file(dst / entry["file"])
    assert (static_flow_bundle / "manifest.json").read_text() == before
    assert manifest["stages"]["flow_estimator"] == json.loads(before)["stages"]["flow_estimator"]

    rng = np.random.default_rng(4)
    w = STATIC_FLOW_WINDOWS[0]
    entry = manifest["stages"][f"flow_estimator_batch_b1_w{w}"]
    feeds = _feeds(rng, int(next(s["shape"][1] for s in entry["inputs"] if s["name"] == "x")), w)
    out, dtype = _run(dst, feeds, 8)
    ref, ref_dtype = _run(static_flow_fused_fp16_bundle, feeds, 8)
    assert dtype is ref_dtype is np.float16
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-6 * float(np.abs(ref).max()))
