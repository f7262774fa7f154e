"""The TensorRT path's pure logic, on the CPU: optimization profiles, the
device KV-cache plan (checked numerically against the plain host loop over
onnxruntime), the precision rule, engine metadata checks and their
messages, manifest updates, the Jetson memory budget, and the GPU/TensorRT
probes on a machine without either."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cosyedge_build.tensorrt.engine_plan import (
    batch_caps,
    build_profiles,
    graph_has_fp16,
    onnx_input_specs,
    precision_mode,
    workspace_bytes,
)
from cosyedge_build.tensorrt.engines import guess_board
from cosyedge_daemon.cli.build_engines import add_engines_arguments
from cosyedge_models.backends.engine_meta import (
    EngineIdentity,
    check_engines,
    engine_mismatches,
    engine_warnings,
    plan_file_name,
    trt_release,
    with_engines,
    write_manifest,
)
from cosyedge_models.backends.gpu_probe import _is_real_tensorrt, probe_gpu, probe_tensorrt
from cosyedge_models.backends.kv_layout import KvPlan, MaskFill, bucket_mask, decode_buckets
from cosyedge_models.backends.profiles import (
    ShapeRange,
    all_input_ranges,
    cap_profile,
    choose_profile,
    eval_dim,
    stage_profiles,
)
from cosyedge_models.backends.report import engine_report, tensorrt_status
from cosyedge_models.bundle.loader import FORMAT_VERSION, STAGES, STATIC_FLOW_PREFIX, STATIC_VOCODER_PREFIX, load_bundle
from cosyedge_models.bundle.memory_budget import BOARDS, GIB, MIB, Board, bundle_budget, format_table
from cosyedge_models.errors import BundleError, SynthesisError
from onnx import TensorProto, helper, numpy_helper

from tests.support.components import not_here, require_module

# --- profiles ------------------------------------------------------------------------------


def test_eval_dim_reads_symbols_and_small_expressions() -> None:
    vals = {"T": 10, "P": 7, "B": 2}
    assert eval_dim(5, vals) == 5
    assert eval_dim("T", vals) == 10
    assert eval_dim("P + 1", vals) == 8
    assert eval_dim("2*T", vals) == 20
    assert eval_dim("T * 480 // 2 - 1", vals) == 2399
    with pytest.raises(BundleError, match="'Q'"):
        eval_dim("Q + 1", vals)
    with pytest.raises(BundleError, match="not an int"):
        eval_dim("__import__('os')", vals)


def test_stage_profiles_validate_ranges() -> None:
    assert stage_profiles({"profile": {"T": [1, 64, 512]}}, "s") == [{"T": (1, 64, 512)}]
    assert len(stage_profiles({"profile": [{"T": [1, 8, 64]}, {"T": [64, 256, 512]}]}, "s")) == 2
    with pytest.raises(BundleError, match=r"stages\.s\.profile 'T'.*min <= opt <= max"):
        stage_profiles({"profile": {"T": [8, 4, 64]}}, "s")
    with pytest.raises(BundleError, match=r"\[min, opt, max\] ints"):
        stage_profiles({"profile": {"T": [1, 64]}}, "s")


def _decode_entry(p_max: int = 2048) -> dict[str, Any]:
    return {"inputs": [{"name": "inputs_embeds", "shape": ["B", 1, 896]},
                       {"name": "attention_mask", "shape": ["B", "P + 1"]},
                       {"name": "past_kv", "shape": [24, 2, "B", 2, "P", 64]}],
            "profile": [{"B": [1, 1, 1], "P": [1, 64, 256]}, {"B": [1, 1, 2], "P": [1, 512, p_max]}]}


def test_input_ranges_and_choose_profile() -> None:
    profiles = all_input_ranges(_decode_entry(), "llm_decode")
    assert profiles[0]["attention_mask"] == ShapeRange((1, 2), (1, 65), (1, 257))
    assert profiles[1]["past_kv"].max == (24, 2, 2, 2, 2048, 64)
    small = {"inputs_embeds": (1, 1, 896), "attention_mask": (1, 101), "past_kv": (24, 2, 1, 2, 100, 64)}
    assert choose_profile(profiles, small, "llm_decode") == 0  # both fit; the smaller one wins
    big = {**small, "attention_mask": (1, 1001), "past_kv": (24, 2, 1, 2, 1000, 64)}
    assert choose_profile(profiles, big, "llm_decode") == 1
    with pytest.raises(SynthesisError, match=r"outside the engine's optimization profiles.*rebuild"):
        choose_profile(profiles, {**small, "past_kv": (24, 2, 1, 2, 4096, 64)}, "llm_decode")


def test_cap_profile_and_batch_caps() -> None:
    assert cap_profile({"B": (1, 2, 8), "T": (1, 64, 512)}, {"B": 1}) == {"B": (1, 1, 1), "T": (1, 64, 512)}
    assert batch_caps([{"N": (2, 2, 8)}, {"B": (1, 1, 4)}], 2) == {"B": 2, "N": 4}
    assert batch_caps([{"T": (1, 1, 4)}], None) == {}


# --- the device KV-cache plan ---------------------------------------------------------------

# The device KV plan as TrtDecodeLoop executes it (exact ping-pong and bucketed with CUDA graphs,
# across buckets, against the host loop) runs on the real class under the TensorRT emulator:
# tests/models/backends/test_trt_backend.py::test_decode_loop_matches_host_loop.


def test_kv_plan_limits_and_ops() -> None:
    plan = KvPlan(rows=4, head_dim=2, itemsize=4, p_max=8, buckets=decode_buckets(1, 8, smallest=4))
    ops = plan.start(3)
    assert plan.past_dim == 4 and plan.past_buf == "a" and plan.present_buf == "b"
    assert ops[-1] == MaskFill(3, 4)
    np.testing.assert_array_equal(bucket_mask(3, 4), [[1, 1, 1, 0, 1]])
    plan.advance()  # 4 valid: still bucket 4
    assert (plan.past_len, plan.past_dim) == (4, 4)
    plan.advance()  # 5 valid: bucket 8
    assert (plan.past_len, plan.past_dim) == (5, 8)
    for _ in range(3):
        plan.advance()
    assert plan.past_len == 8
    with pytest.raises(SynthesisError, match="maximum of 8.*rebuild the engines"):
        plan.advance()
    exact = KvPlan(rows=4, head_dim=2, itemsize=4, p_max=8, buckets=None)
    with pytest.raises(SynthesisError, match="maximum of 8"):
        exact.start(9)
    assert decode_buckets(100, 2048) == [128, 256, 512, 1024, 2048]


# --- the precision rule and the builder's plan -------------------------------------------


def _tiny_model(kind: str) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    inits = [w]
    if kind == "qdq":
        inits += [numpy_helper.from_array(np.array(0.1, np.float32), "s"),
                  numpy_helper.from_array(np.array(0, np.int8), "z")]
        nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
                 helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
                 helper.make_node("MatMul", ["xd", "w"], ["y"], name="mm")]
    if kind == "fp16":
        nodes = [helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16, name="c"),
                 helper.make_node("Cast", ["xh"], ["xf"], to=TensorProto.FLOAT, name="c2"),
                 helper.make_node("MatMul", ["xf", "w"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_precision_rule() -> None:
    """Every engine is strongly typed; the graph's types say where the precision comes from."""
    plain = precision_mode(_tiny_model("fp32"))
    assert plain.strongly_typed and plain.carried_by == "fp32"
    qdq = precision_mode(_tiny_model("qdq"))
    assert qdq.strongly_typed and qdq.carried_by == "Q/DQ" and qdq.fp32_nodes == ()
    kept = precision_mode(_tiny_model("qdq"), ["mm"])
    assert kept.strongly_typed and kept.fp32_nodes == ("mm",)
    typed = precision_mode(_tiny_model("fp16"))
    assert graph_has_fp16(_tiny_model("fp16")) and typed.strongly_typed and typed.carried_by == "fp16 casts"
    with pytest.raises(BundleError, match="nodes the graph lacks"):
        precision_mode(_tiny_model("qdq"), ["nope"])


def test_build_profiles_from_onnx_inputs_when_manifest_has_no_shapes() -> None:
    model = _tiny_model("fp32")
    assert onnx_input_specs(model) == [{"name": "x", "shape": ["B", "T", 4]}]
    entry = {"profile": {"B": [1, 1, 4], "T": [1, 32, 256]}}
    profs = build_profiles(entry, "s", model, caps={"B": 2})
    assert profs == [{"x": ShapeRange((1, 1, 4), (1, 32, 4), (2, 256, 4))}]


def test_workspace_defaults_and_board_guess() -> None:
    assert workspace_bytes("orin-nano-8gb", None) == 512 * MIB
    assert workspace_bytes(None, 300) == 300 * MIB
    assert workspace_bytes(None, None) == 1024 * MIB
    with pytest.raises(ValueError, match="allowed: orin-nano-8gb"):
        workspace_bytes("tx2", None)
    assert guess_board("Orin", int(7.4 * GIB)) == "orin-nano-8gb"
    assert guess_board("Orin", int(15.3 * GIB)) == "orin-nx-16gb"
    assert guess_board("NVIDIA H200", 140 * GIB) is None


def test_engines_cli_arguments() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bundle", required=True)
    add_engines_arguments(p)
    args = p.parse_args(["--bundle", "B", "--board", "orin-nano-8gb", "--workspace-mib", "256", "--stages",
                         "llm_decode,flow_estimator", "--precision", "int8"])
    assert (args.board, args.workspace_mib, args.stages, args.precision) == (
        "orin-nano-8gb", 256, "llm_decode,flow_estimator", "int8")


# --- engine metadata, manifest update, load refusal -----------------------------------------

LOCAL = EngineIdentity("10.3.0.30", "Orin", "8.7", 8)


def _engines_meta(**over: Any) -> dict[str, Any]:
    meta = {"tensorrt": "10.3.0.26", "gpu": "Orin", "compute_capability": "8.7", "multiprocessors": 8,
            "precision": "fp32",
            "stages": {s: {"file": plan_file_name(s, "fp32"), "sha256": "p" + s, "onnx": f"{s}.onnx",
                           "onnx_sha256": "o" + s, "precision": "fp32"} for s in STAGES}}
    meta.update(over)
    return meta


def test_mismatch_messages() -> None:
    assert trt_release("10.3.0.30") == (10, 3, 0)
    assert engine_mismatches(_engines_meta(), LOCAL) == []  # build number differs only
    msgs = engine_mismatches(_engines_meta(tensorrt="10.13.0.35", compute_capability="9.0", gpu="NVIDIA H200"),
                             LOCAL)
    assert msgs == ["built with TensorRT 10.13.0.35, this device has TensorRT 10.3.0.30",
                    "built for compute capability 9.0 (NVIDIA H200), this GPU is 8.7 (Orin)"]
    assert engine_mismatches(_engines_meta(gpu="Xavier"), LOCAL) == ["built for GPU 'Xavier', this GPU is 'Orin'"]
    assert "16 multiprocessors" in engine_warnings(_engines_meta(multiprocessors=16), LOCAL)[0]


def _write_bundle(root: Path, engines: dict[str, Any] | None = None, plans: bool = True) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    stages = {}
    for s in STAGES:
        (root / f"{s}.onnx").write_bytes(b"onnx-" + s.encode())
        (root / f"{s}.int8.onnx").write_bytes(b"int8-" + s.encode())
        stages[s] = {"file": f"{s}.onnx", "sha256": "o" + s, "precision": "fp32",
                     "variants": {"int8": {"file": f"{s}.int8.onnx", "sha256": "q" + s, "precision": "int8"}}}
        if plans:
            (root / plan_file_name(s, "fp32")).write_bytes(b"plan")
    manifest = {"format": "cosyedge-bundle", "format_version": FORMAT_VERSION, "family": "cosyvoice2",
                "precision": "fp32",
                "sample_rate": 24000, "token_mel_ratio": 2, "mel_bins": 80,
                "llm": {"hidden_size": 8, "num_layers": 2, "num_kv_heads": 2, "head_dim": 4,
                        "speech_token_size": 8},
                "flow": {"pre_lookahead_len": 3, "chunk_tokens": 25}, "hift": {"upsample_factor": 480,
                                                                              "harmonics": 9},
                "streaming": {"token_hop_len": 25, "mel_cache_len": 8, "source_cache_len": 3840},
                "stages": stages, "engines": engines}
    write_manifest(root, manifest)
    return manifest


def test_load_bundle_trt_uses_plans_and_refuses_mismatches(tmp_path: Path) -> None:
    root = tmp_path / "b"
    _write_bundle(root, _engines_meta())
    bundle = load_bundle(root, backend="trt", identity=LOCAL)
    assert bundle.stages["llm_decode"].path == root / "llm_decode.fp32.plan"
    assert bundle.stages["llm_decode"].sha256 == "pllm_decode"
    assert bundle.engines is not None and bundle.backend == "trt"
    assert load_bundle(root).stages["llm_decode"].path == root / "llm_decode.onnx"  # ort unchanged
    with pytest.raises(BundleError, match=rf"built with TensorRT 10\.3\.0\.26, this device has TensorRT 10\.13\.0\.35; "
                                          rf"rebuild them on this device with: cosyedge build engines --bundle {root}"):
        load_bundle(root, backend="trt", identity=EngineIdentity("10.13.0.35", "Orin", "8.7"))
    with pytest.raises(BundleError, match="compute capability 8.7 \\(Orin\\), this GPU is 9.0"):
        load_bundle(root, backend="trt", identity=EngineIdentity("10.3.0.30", "NVIDIA H200", "9.0"))
    with pytest.raises(BundleError, match="built from the fp32 stages, not int8.*--precision int8"):
        load_bundle(root, precision="int8", backend="trt", identity=LOCAL)


def test_load_bundle_trt_without_engines_or_with_stale_ones(tmp_path: Path) -> None:
    _write_bundle(tmp_path / "none", None)
    with pytest.raises(BundleError, match="has no TensorRT engines; build them on this device with: "
                                          "cosyedge build engines --bundle"):
        load_bundle(tmp_path / "none", backend="trt", identity=LOCAL)
    stale = _engines_meta()
    stale["stages"]["flow_estimator"]["onnx_sha256"] = "older"
    _write_bundle(tmp_path / "stale", stale)
    with pytest.raises(BundleError, match="re-exported or re-quantized since"):
        load_bundle(tmp_path / "stale", backend="trt", identity=LOCAL)
    _write_bundle(tmp_path / "noplans", _engines_meta(), plans=False)
    with pytest.raises(BundleError, match="engine file llm_prefill.fp32.plan is missing"):
        load_bundle(tmp_path / "noplans", backend="trt", identity=LOCAL)
    # Without a GPU, probing the device refuses with the reason rather than crashing.
    if not probe_gpu().available:
        with pytest.raises(BundleError, match="cannot use TensorRT engines here.*no GPU"):
            load_bundle(tmp_path / "stale", backend="trt")


def test_manifest_update_is_atomic_and_keeps_the_rest(tmp_path: Path) -> None:
    manifest = _write_bundle(tmp_path / "b", None)
    updated = with_engines(manifest, _engines_meta())
    assert manifest["engines"] is None and updated["stages"] == manifest["stages"]
    write_manifest(tmp_path / "b", updated)
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["engines"]["tensorrt"] == "10.3.0.26"
    assert not list((tmp_path / "b").glob(".manifest-*"))
    with pytest.raises(ValueError, match="lacks"):
        with_engines(manifest, {"tensorrt": "10"})
    assert check_engines(updated, tmp_path / "b", LOCAL)["gpu"] == "Orin"


# --- the Jetson memory budget -----------------------------------------------------------

REAL_LLM = {"hidden_size": 896, "num_layers": 24, "num_kv_heads": 2, "head_dim": 64, "speech_token_size": 6561}


def _full_size_manifest(root: Path, sizes_mib: dict[str, int]) -> dict[str, Any]:
    """CosyVoice2-0.5B dimensions and fp32 file sizes, as sparse files."""
    root.mkdir(parents=True, exist_ok=True)
    shapes = {
        "llm_prefill": ([{"name": "inputs_embeds", "shape": ["B", "T", 896]},
                         {"name": "attention_mask", "shape": ["B", "T"]}], {"B": [1, 1, 1], "T": [1, 128, 512]}),
        "llm_decode": ([{"name": "inputs_embeds", "shape": ["B", 1, 896]},
                        {"name": "attention_mask", "shape": ["B", "P + 1"]},
                        {"name": "past_kv", "shape": [24, 2, "B", 2, "P", 64]}], {"B": [1, 1, 1], "P": [1, 256, 2048]}),
        "flow_encoder": ([{"name": "token", "shape": ["B", "T"]}, {"name": "embedding", "shape": ["B", 192]}],
                         {"B": [1, 1, 1], "T": [1, 100, 600]}),
        "flow_estimator": ([{"name": n, "shape": ["N", 80, "T"]} for n in ("x", "mu", "cond")],
                           {"N": [2, 2, 2], "T": [2, 200, 1200]}),
        "hift_source": ([{"name": "mel", "shape": ["B", 80, "T"]}, {"name": "noise", "shape": ["B", "T*480", 9]}],
                        {"B": [1, 1, 1], "T": [1, 100, 600]}),
        "hift_decoder": ([{"name": "mel", "shape": ["B", 80, "T"]}, {"name": "source", "shape": ["B", 1, "T*480"]}],
                         {"B": [1, 1, 1], "T": [1, 100, 600]}),
    }
    stages = {}
    for s, (inputs, profile) in shapes.items():
        with (root / f"{s}.onnx").open("wb") as f:
            f.truncate(sizes_mib[s] * MIB)
        stages[s] = {"file": f"{s}.onnx", "precision": "fp32", "inputs": inputs, "profile": profile}
    return {"llm": REAL_LLM, "mel_bins": 80, "stages": stages}


SIZES = {"llm_prefill": 1430, "llm_decode": 1430, "flow_encoder": 80, "flow_estimator": 300, "hift_source": 2,
         "hift_decoder": 80}


def test_budget_per_precision_and_boards(tmp_path: Path) -> None:
    manifest = _full_size_manifest(tmp_path, SIZES)
    budgets = {p: bundle_budget(tmp_path, manifest, p) for p in ("fp32", "fp16", "int8")}
    fp32, fp16, int8 = budgets["fp32"], budgets["fp16"], budgets["int8"]
    dec = next(s for s in fp32.stages if s.stage == "llm_decode")
    # two max-length KV caches of [24, 2, 1, 2, 2049, 64] fp32 + the embedding buffers
    assert dec.io_bytes == 2 * 24 * 2 * 2 * 2049 * 64 * 4 + 2 * 896 * 4
    assert dec.weights_source == "onnx" and dec.contexts == 1  # the decode loop's contexts share one scratch
    assert {s.weights_source for s in int8.stages} == {"derived"}
    assert int8.engines_bytes < fp16.engines_bytes < fp32.engines_bytes
    nano = BOARDS["orin-nano-8gb"]
    assert int8.fit(nano)["spare_bytes"] > fp16.fit(nano)["spare_bytes"] > fp32.fit(nano)["spare_bytes"]
    assert int8.fit(nano)["fits"], int8.fit(nano)
    small = Board("small", "a 4.5 GiB module", "-", int(4.5 * GIB))
    assert int8.fit(small)["fits"] and not fp32.fit(small)["fits"]
    fit = int8.fit(nano)
    assert fit["needed_bytes"] == int8.engines_bytes + int8.cpu_side_bytes + nano.os_bytes + nano.runtime_bytes
    assert "llm_prefill and llm_decode each hold a copy" in fp32.notes[0]
    table = format_table(list(budgets.values()))
    assert table.splitlines()[0].startswith("precision") and "fits" in table.splitlines()[3]


def test_budget_prefers_measured_engine_values(tmp_path: Path) -> None:
    manifest = _full_size_manifest(tmp_path, SIZES)
    manifest["engines"] = {"precision": "int8", "stages": {
        "flow_estimator": {"plan_bytes": 77 * MIB, "device_memory_bytes": 5 * MIB}}}
    est = next(s for s in bundle_budget(tmp_path, manifest, "int8").stages if s.stage == "flow_estimator")
    assert (est.weights_bytes, est.activation_bytes) == (77 * MIB, 5 * MIB)
    assert (est.weights_source, est.activation_source) == ("plan", "measured")


def test_budget_counts_the_fixed_shape_engines(tmp_path: Path) -> None:
    """Built fixed-shape engines count their plans (a weight copy each) and each family's
    largest device memory once (one shared activation buffer); unbuilt ones are a note."""
    manifest = _full_size_manifest(tmp_path, SIZES)
    for w in (64, 128):
        (tmp_path / f"{STATIC_FLOW_PREFIX}{w}.onnx").write_bytes(b"x" * 1000)
        manifest["stages"][f"{STATIC_FLOW_PREFIX}{w}"] = {"file": f"{STATIC_FLOW_PREFIX}{w}.onnx", "precision": "fp32"}
    (tmp_path / f"{STATIC_VOCODER_PREFIX}50.onnx").write_bytes(b"x" * 3 * MIB)
    manifest["stages"][f"{STATIC_VOCODER_PREFIX}50"] = {"file": f"{STATIC_VOCODER_PREFIX}50.onnx", "precision": "fp32"}
    before = bundle_budget(tmp_path, manifest, "int8")
    assert not any(s.stage.startswith(STATIC_FLOW_PREFIX) for s in before.stages)
    unbuilt = f"{STATIC_VOCODER_PREFIX}*: 1 fixed-shape graphs without engines (3 MiB"
    assert any(n.startswith(unbuilt) for n in before.notes)
    manifest["engines"] = {"precision": "int8", "stages": {
        f"{STATIC_FLOW_PREFIX}64": {"plan_bytes": 90 * MIB, "device_memory_bytes": 10 * MIB},
        f"{STATIC_FLOW_PREFIX}128": {"plan_bytes": 90 * MIB, "device_memory_bytes": 25 * MIB}}}
    after = bundle_budget(tmp_path, manifest, "int8")
    fixed = [s for s in after.stages if s.stage.startswith(STATIC_FLOW_PREFIX)]
    assert [s.weights_bytes for s in fixed] == [90 * MIB, 90 * MIB]
    assert sum(s.activation_bytes for s in fixed) == 25 * MIB  # the largest, once
    assert after.engines_bytes - before.engines_bytes == 180 * MIB + 25 * MIB
    assert any("2 fixed-shape engines, each with its own copy of the weights" in n for n in after.notes)


def test_engine_report_without_gpu(tmp_path: Path) -> None:
    manifest = _full_size_manifest(tmp_path, SIZES)
    manifest.update({"format": "cosyedge-bundle", "engines": None})
    write_manifest(tmp_path, manifest)
    report = engine_report(tmp_path)
    assert report["engines"]["built"] is False and "cosyedge build engines --bundle" in report["engines"]["fix"]
    assert set(report["budget"]) == {"fp32", "fp16", "int8"}
    assert report["budget"]["int8"]["boards"][0]["board"] == "orin-nano-8gb"
    assert "OS 1.0 GiB" in report["assumptions"]
    assert "error" in engine_report(tmp_path / "missing")


# --- probes: no GPU here, and the stubs are not TensorRT -----------------------------------


def test_probes_report_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = probe_gpu()
    trt = probe_tensorrt()
    if gpu.available:
        not_here("this machine has a GPU; the no-GPU path is checked elsewhere")
    assert not trt.available and trt.reason.startswith("no GPU:")
    status = tensorrt_status()
    assert status["usable"] is False and status["gpu"]["available"] is False
    assert any("no GPU" in f for f in status["fix"])


def test_stub_package_is_not_mistaken_for_tensorrt() -> None:
    mod = require_module("tensorrt", "tensorrt-stubs: pip install --no-deps -r .ci/requirements-nodeps.txt")
    # The import succeeds (an empty namespace package of .pyi files) ...
    if _is_real_tensorrt(mod):
        not_here("a real TensorRT is installed here")
    # ... but it is recognised as not being TensorRT.
    assert not hasattr(mod, "Builder")


# --- one LLM engine: llm_decode's prefill profile serves llm_prefill ------------------------


def test_llm_decode_has_a_step_and_a_prefill_profile(tiny_bundle: Path) -> None:
    from cosyedge_build.export.llm import PREFILL_T, PREFIX_POSITIONS_MAX
    from cosyedge_build.tensorrt.engine_plan import prefill_profiles

    entry = json.loads((tiny_bundle / "manifest.json").read_text())["stages"]["llm_decode"]
    assert prefill_profiles(entry) == [1]
    step, prefill = build_profiles(entry, "llm_decode", None)
    assert step["inputs_embeds"].max[1] == 1 and step["past_kv"].min[4] == 1
    assert prefill["inputs_embeds"].max[1] == PREFILL_T[2]
    assert (prefill["past_kv"].min[4], prefill["past_kv"].max[4]) == (0, PREFIX_POSITIONS_MAX)
    assert prefill_profiles({"profile": {"B": [1, 1, 1], "P": [1, 256, 2047], "T": [1, 1, 1]}}) == []


def test_the_decode_graph_runs_the_prefill_over_an_empty_past_and_a_saved_prefix(tiny_bundle: Path) -> None:
    """What the one LLM engine computes in its prefill profile, on onnxruntime: llm_decode
    over an empty past (P = 0) equals llm_prefill, and over a saved prefix it equals the
    prefill of prefix + the rest."""
    llm = json.loads((tiny_bundle / "manifest.json").read_text())["llm"]
    pre = ort.InferenceSession(str(tiny_bundle / "llm_prefill.onnx"), providers=["CPUExecutionProvider"])
    dec = ort.InferenceSession(str(tiny_bundle / "llm_decode.onnx"), providers=["CPUExecutionProvider"])
    embeds = (np.random.default_rng(3).standard_normal((1, 7, int(llm["hidden_size"]))) * 0.1).astype(np.float32)
    ref_logp, ref_kv = pre.run(None, {"inputs_embeds": embeds, "attention_mask": np.ones((1, 7), np.int64)})
    empty = np.zeros((int(llm["num_layers"]), 2, 1, int(llm["num_kv_heads"]), 0, int(llm["head_dim"])), np.float32)
    logp, kv = dec.run(None, {"inputs_embeds": embeds, "attention_mask": np.ones((1, 7), np.int64), "past_kv": empty})
    np.testing.assert_allclose(logp, ref_logp, rtol=0, atol=1e-5)
    np.testing.assert_allclose(kv, ref_kv, rtol=0, atol=1e-5)
    _, prefix = pre.run(None, {"inputs_embeds": embeds[:, :3], "attention_mask": np.ones((1, 3), np.int64)})
    logp2, kv2 = dec.run(None, {"inputs_embeds": embeds[:, 3:], "attention_mask": np.ones((1, 7), np.int64),
                                "past_kv": prefix})
    np.testing.assert_allclose(logp2, ref_logp, rtol=0, atol=1e-5)
    np.testing.assert_allclose(kv2, ref_kv, rtol=0, atol=1e-5)


def test_profile_choice_keeps_steps_and_prefills_apart() -> None:
    def prof(t: int, p_lo: int, p_hi: int) -> dict[str, ShapeRange]:
        return {"inputs_embeds": ShapeRange((1, 1, 8), (1, 1, 8), (1, t, 8)),
                "past_kv": ShapeRange((2, 2, 1, 2, p_lo, 4), (2, 2, 1, 2, p_lo, 4), (2, 2, 1, 2, p_hi, 4))}

    step, prefill = prof(1, 1, 2047), prof(512, 0, 256)
    short_step = {"inputs_embeds": (1, 1, 8), "past_kv": (2, 2, 1, 2, 10, 4)}
    # both cover a step over a short past, and the prefill profile's buffers are smaller:
    assert choose_profile([step, prefill], short_step, "llm_decode") == 1
    # so the loop chooses among its step profiles only (TrtDecodeLoop._steps)
    assert choose_profile([step], short_step, "llm_decode") == 0
    assert choose_profile([prefill], {"inputs_embeds": (1, 7, 8), "past_kv": (2, 2, 1, 2, 0, 4)}, "p") == 0


def test_one_llm_engine_in_the_manifest_budget_and_checks(tmp_path: Path) -> None:
    meta = _engines_meta()
    step_kv = [[2, 2, 1, 2, 1, 4]] * 2 + [[2, 2, 1, 2, 9, 4]]
    prefill_kv = [[2, 2, 1, 2, 0, 4]] * 2 + [[2, 2, 1, 2, 8, 4]]
    meta["stages"]["llm_decode"]["profiles"] = [
        {"inputs_embeds": [[1, 1, 8], [1, 1, 8], [1, 1, 8]], "past_kv": step_kv},
        {"inputs_embeds": [[1, 1, 8], [1, 9, 8], [1, 64, 8]], "past_kv": prefill_kv}]
    meta["stages"]["llm_prefill"] = {**meta["stages"]["llm_decode"], "engine_of": "llm_decode", "profiles_used": [1]}
    root = tmp_path / "b"
    _write_bundle(root, meta)
    bundle = load_bundle(root, backend="trt", identity=LOCAL)
    assert bundle.stages["llm_prefill"].path == bundle.stages["llm_decode"].path  # one plan, one engine
    assert bundle.llm_decode_positions  # the prefill profile takes a saved prefix
    single = _engines_meta()
    _write_bundle(tmp_path / "two", single)
    assert not load_bundle(tmp_path / "two", backend="trt", identity=LOCAL).llm_decode_positions
    # the staleness check follows the engine to llm_decode's ONNX
    stale = json.loads(json.dumps(meta))
    stale["stages"]["llm_prefill"]["onnx_sha256"] = "older"
    _write_bundle(tmp_path / "stale", stale)
    with pytest.raises(BundleError, match="re-exported or re-quantized since"):
        load_bundle(tmp_path / "stale", backend="trt", identity=LOCAL)
    # the budget counts the one engine's weights once
    manifest = _full_size_manifest(tmp_path / "full", SIZES)
    manifest["engines"] = {"precision": "int8", "stages": {
        "llm_decode": {"plan_bytes": 500 * MIB}, "llm_prefill": {"plan_bytes": 500 * MIB, "engine_of": "llm_decode"}}}
    budget = bundle_budget(tmp_path / "full", manifest, "int8")
    stages = {s.stage: s for s in budget.stages}
    assert stages["llm_decode"].weights_bytes == 500 * MIB and stages["llm_prefill"].weights_bytes == 0
    assert stages["llm_prefill"].weights_source == "plan of llm_decode"
    assert any("one TensorRT engine" in n for n in budget.notes)
