"""One copy of the LLM weights: the export pass that writes them once and the
onnxruntime backend that hands the same buffers to every LLM session."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from cosyedge_build.export.shared_weights import share_weights
from cosyedge_models.backends.ort import OrtBackend, OrtSession
from cosyedge_models.backends.shared_weights import INDEX_FORMAT, find_index, read_index
from cosyedge_models.errors import BundleError
from onnx import TensorProto, helper, numpy_helper

from tests.support.components import require_cuda_provider

LLM_GRAPHS = ("llm_prefill.onnx", "llm_decode.onnx", "llm_decode_static.onnx")


def _pss_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise AssertionError("no Pss in smaps_rollup")


def _chain_model(weights: list[np.ndarray], prefix: str) -> onnx.ModelProto:
    """x @ w0 @ w1 ...; initializer names differ per graph (as the exporter's do)."""
    nodes, inits, x = [], [], "x"
    for i, w in enumerate(weights):
        inits.append(numpy_helper.from_array(w, f"{prefix}_w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"{prefix}_w{i}"], [f"h{i}"]))
        x = f"h{i}"
    n = weights[0].shape[0]
    graph = helper.make_graph(nodes, prefix, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", n])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["B", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture()
def shared_dir(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal((1024, 1024)) * 0.03).astype(np.float32) for _ in range(8)]
    for name in ("a", "b", "c"):
        onnx.save(_chain_model(weights, name), str(tmp_path / f"{name}.onnx"))
    return tmp_path, weights


def test_tiny_bundle_llm_graphs_share_one_data_file(tiny_static_bundle: Path) -> None:
    index_path = find_index(tiny_static_bundle / "llm_decode.onnx")
    assert index_path is not None and index_path.name == "llm_weights.json"
    index = read_index(index_path)
    assert index["format"] == INDEX_FORMAT and sorted(index["graphs"]) == sorted(LLM_GRAPHS)
    weights = 0
    for graph in LLM_GRAPHS:
        model = onnx.load(str(tiny_static_bundle / graph), load_external_data=False)
        external = [t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]
        assert external and {e.value for t in external for e in t.external_data if e.key == "location"} == {
            "llm_weights.bin"}
        assert {t.name for t in external} <= set(index["tensors"])
        weights = max(weights, sum(int(np.prod(t.dims)) * 4 for t in external))
    # each distinct tensor once: the data holds one graph's weights (and alignment padding), not three
    payload = sum(t["nbytes"] for t in index["tensors"].values())
    assert payload == weights
    manifest = json.loads((tiny_static_bundle / "manifest.json").read_text())
    for stage in ("llm_prefill", "llm_decode", "llm_decode_static"):
        assert manifest["stages"][stage]["shared_weights"]["file"] == "llm_weights.bin"


def test_backend_maps_shared_weights_once_for_all_llm_sessions(tiny_static_bundle: Path) -> None:
    backend = OrtBackend(["CPUExecutionProvider"])
    sessions = [backend.load(g.removesuffix(".onnx"), tiny_static_bundle / g, threads=1) for g in LLM_GRAPHS]
    try:
        assert all(isinstance(s, OrtSession) and s.shares_weights for s in sessions)
        open_files = backend._shared.open_files()
        assert len(open_files) == 1
        shared = next(iter(open_files.values()))
        name, array = next(iter(shared.arrays.items()))
        # the runtime value is the mapped file itself, not a copy
        assert shared.values[name].data_ptr() == array.ctypes.data
        counted = sum(s.memory_bytes() for s in sessions)
        own = sum((tiny_static_bundle / g).stat().st_size for g in LLM_GRAPHS)
        assert counted == own + shared.nbytes
    finally:
        for s in sessions:
            s.close()
    assert not backend._shared.open_files()


def test_shared_weights_give_the_same_outputs_and_one_physical_copy(shared_dir: tuple[Path, list[np.ndarray]]) -> None:
    root, weights = shared_dir
    x = np.random.default_rng(1).standard_normal((2, 1024)).astype(np.float32)
    import onnxruntime as ort

    before = ort.InferenceSession(str(root / "b.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    index = share_weights(root, ["a.onnx", "b.onnx", "c.onnx"], "llm_weights.bin")
    assert len(index["tensors"]) == len(weights)
    assert (root / "b.onnx").stat().st_size < 4096  # the weights left the graph file
    backend = OrtBackend(["CPUExecutionProvider"])
    pss0 = _pss_kib()
    sessions = [backend.load(n, root / f"{n}.onnx", threads=1) for n in ("a", "b", "c")]
    try:
        outs = [s.run({"x": x})[next(iter(s.output_names))] for s in sessions]
        grown = (_pss_kib() - pss0) * 1024
        for out in outs:
            np.testing.assert_allclose(out, before, rtol=1e-5, atol=1e-5)
        one_copy = sum(w.nbytes for w in weights)
        # three unshared sessions hold >= 3 copies (prepacked); shared ones one, plus runtime overhead
        assert grown < 2 * one_copy, (grown, one_copy)
    finally:
        for s in sessions:
            s.close()


def test_a_truncated_shared_file_is_refused(shared_dir: tuple[Path, list[np.ndarray]]) -> None:
    root, _ = shared_dir
    share_weights(root, ["a.onnx", "b.onnx"], "llm_weights.bin")
    data = root / "llm_weights.bin"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(BundleError, match="beyond the file's end"):
        OrtBackend(["CPUExecutionProvider"]).load("a", root / "a.onnx")


def test_memory_budget_counts_the_shared_llm_weights_once(tiny_bundle: Path) -> None:
    from cosyedge_models.bundle.memory_budget import bundle_budget

    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    index = read_index(tiny_bundle / "llm_weights.json")
    budget = bundle_budget(tiny_bundle, manifest, "fp32")
    stages = {s.stage: s for s in budget.stages}
    prefill, decode = stages["llm_prefill"].weights_bytes, stages["llm_decode"].weights_bytes
    held = sum(t["nbytes"] for t in index["tensors"].values())  # the weights, not the file's alignment padding
    assert 0 < held <= index["bytes"]
    assert prefill == (tiny_bundle / "llm_prefill.onnx").stat().st_size + held
    assert decode == (tiny_bundle / "llm_decode.onnx").stat().st_size  # its weights are prefill's
    assert any("share one copy" in n for n in budget.notes)


@pytest.mark.gpu
def test_cuda_sessions_hold_one_device_copy(shared_dir: tuple[Path, list[np.ndarray]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CUDA provider the shared weights are device buffers handed to every
    session: three sessions hold one device copy, with unchanged outputs."""
    import onnxruntime as ort
    from cosyedge_models.backends.gpu_probe import device_memory_used

    require_cuda_provider()
    root, weights = shared_dir
    x = np.random.default_rng(1).standard_normal((2, 1024)).astype(np.float32)
    expected = ort.InferenceSession(str(root / "b.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    share_weights(root, ["a.onnx", "b.onnx", "c.onnx"], "llm_weights.bin")
    grown: dict[str, int] = {}
    outputs: dict[str, list[np.ndarray]] = {}
    for flag in ("1", "0"):  # shared first: memory a closed session leaves in a pool is not counted against it
        monkeypatch.setenv("COSYEDGE_ORT_SHARE_WEIGHTS", flag)
        backend = OrtBackend(["CUDAExecutionProvider", "CPUExecutionProvider"])
        start = device_memory_used()
        sessions = [backend.load(n, root / f"{n}.onnx", threads=1) for n in ("a", "b", "c")]
        try:
            assert all(s.shares_weights == (flag == "1") for s in sessions)
            outputs[flag] = [s.run({"x": x})[s.output_names[0]] for s in sessions]
            for y in outputs[flag]:  # the CUDA provider's MatMuls run in TF32: ~2e-3 from the CPU here
                np.testing.assert_allclose(y, expected, rtol=1e-2, atol=1e-2)
            now = device_memory_used()
            assert start is not None and now is not None
            grown[flag] = now - start
        finally:
            for s in sessions:
                s.close()
    for shared, own in zip(outputs["1"], outputs["0"], strict=True):  # the same kernels on the same weights
        np.testing.assert_allclose(shared, own, rtol=1e-5, atol=1e-6)
    one_copy = sum(w.nbytes for w in weights)
    assert grown["0"] - grown["1"] >= 1.5 * one_copy, (grown, one_copy)


def test_the_fused_graphs_share_one_data_file_that_the_step_maps_once(every_graph_bundle: Path) -> None:
    """The fused step's batch sizes and the fixed-length prefill graphs hold one copy of their weights
    (llm_weights.fused.bin, apart from the plain graphs' llm_weights.bin). load_fused_step's sessions
    read it; on the CPU each keeps its own prepacked copy (on CUDA they share one device copy: the
    `-m gpu` tests of test_fused_step.py)."""
    from cosyedge_build.export.llm_fused import has_layer_weights
    from cosyedge_models.batching.fused_step import load_fused_step

    manifest = json.loads((every_graph_bundle / "manifest.json").read_text())
    fused = sorted(n for n in manifest["stages"] if has_layer_weights(n))
    assert len(fused) == 5  # batch sizes 1, 2, 4 and prefill lengths 16, 64
    files = [manifest["stages"][n]["file"] for n in fused]
    index_path = find_index(every_graph_bundle / files[0])
    assert index_path is not None and index_path.name == "llm_weights.fused.json"
    index = read_index(index_path)
    assert sorted(index["graphs"]) == sorted(files)
    assert all(manifest["stages"][n]["shared_weights"]["file"] == "llm_weights.fused.bin" for n in fused)
    own = []
    for file in files:
        model = onnx.load(str(every_graph_bundle / file), load_external_data=False)
        external = [t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]
        assert {e.value for t in external for e in t.external_data if e.key == "location"} == {"llm_weights.fused.bin"}
        own.append(sum(int(index["tensors"][t.name]["nbytes"]) for t in external))
    # each distinct tensor once: the data file holds one graph's layers (the steps also hold the head)
    assert sum(t["nbytes"] for t in index["tensors"].values()) == max(own)
    backend = OrtBackend(["CPUExecutionProvider"])
    prefill = backend.load("llm_prefill", every_graph_bundle / manifest["stages"]["llm_prefill"]["file"], threads=1)
    step = load_fused_step(every_graph_bundle, manifest, prefill, ["CPUExecutionProvider"], ("cpu", 0), 1,
                           captured_prefill=True)
    assert step is not None and step.prefill_lengths == (16, 64)
    try:
        sessions = [*step._steps.values(), *step._prefills.values()]
        assert len(sessions) == 5 and not any(s.shares_weights for s in sessions)
        step.warm_up()  # every graph runs once over the shared file's weights
        assert step.captured_prefill and step.batch_sizes == (1, 2, 4)
    finally:
        step.close()
        prefill.close()


def test_memory_budget_counts_the_fused_steps_weights_once(every_graph_bundle: Path) -> None:
    from cosyedge_models.bundle.memory_budget import bundle_budget, fused_step_bytes

    manifest = json.loads((every_graph_bundle / "manifest.json").read_text())
    index = read_index(every_graph_bundle / "llm_weights.fused.json")
    found = fused_step_bytes(every_graph_bundle, manifest["stages"])
    assert found is not None
    weights, per_row, rows, what = found
    own = sum((every_graph_bundle / g).stat().st_size for g in index["graphs"])
    assert weights == own + sum(int(t["nbytes"]) for t in index["tensors"].values())
    llm = manifest["llm"]  # a row: K and V of every layer over the steps' positions, fp32 here
    assert per_row == 2 * llm["num_layers"] * llm["num_kv_heads"] * 256 * llm["head_dim"] * 4
    assert rows == 4 + 1  # the largest batch's rows and the prefill graphs' scratch row
    assert what == "fp32, batch sizes 1/2/4, prefill lengths 16/64 (one shared copy)"
    notes = bundle_budget(every_graph_bundle, manifest, "fp32").notes
    assert any(n.startswith("fused batched LLM step") and "one shared copy" in n for n in notes)


def test_the_budget_takes_the_fused_steps_fp16_graphs_where_there_are_both() -> None:
    from cosyedge_models.bundle.memory_budget import fused_step_bytes

    def entry(batch: int, dtype: str) -> dict[str, object]:
        shape = [batch, 2, 100, 8]
        return {"file": f"missing_b{batch}_{dtype}.onnx", "batch": batch, "kv_cache": {"dtype": dtype},
                "inputs": [{"name": f"past_{kv}_{i}", "dtype": dtype, "shape": shape}
                           for i in range(3) for kv in ("key", "value")]}

    meta = {"llm_decode_fused_b1": entry(1, "float32"), "llm_decode_fused_b8": entry(8, "float16"),
            "llm_decode_fused_b4": entry(4, "float16")}
    found = fused_step_bytes(Path("/nonexistent"), meta)
    assert found is not None
    weights, per_row, rows, what = found
    assert (weights, per_row, rows) == (0, 6 * 2 * 100 * 8 * 2, 8)  # no files here: no weights counted
    assert what == "fp16, batch sizes 4/8 (a copy in each of 2 graphs)"
    assert fused_step_bytes(Path("/nonexistent"), {"llm_fused_kv_insert": {"file": "x.onnx"}}) is None
