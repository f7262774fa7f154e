"""`cosyedge build quantize` on the tiny bundle: int8 and fp16 bundles load and
synthesize, meet their budget, follow TensorRT's Q/DQ rules; a strict budget
is refused unless forced.

The tiny checkpoint's LLM has random weights, so its next-token distribution
is almost flat (top probability ~5 %): any change of the logits, even fp16's,
reorders the top-k candidates and the seeded sampler diverges within a few
tokens. The end-to-end token budget is therefore relaxed to 0 here; the
default budget (50 %) is meant for trained checkpoints."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from cosyedge_build.quantize.capture import FeedStore, capture_feeds
from cosyedge_build.quantize.metrics import matched_prefix, snr_db
from cosyedge_build.quantize.pipeline import REPORT_FILE, QuantizeBudgetError, quantize_bundle
from cosyedge_build.quantize.qdq_rules import check_qdq
from cosyedge_build.quantize.sensitivity import _outputs
from cosyedge_build.quantize.settings import AccuracyBudget, QuantizeSettings
from cosyedge_build.quantize.texts import HELD_OUT_TEXTS, calibration_texts
from cosyedge_build.tensorrt.engine_plan import precision_mode
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer
from onnx import numpy_helper

# The tiny model's weights are random: its next-token distribution is almost
# flat, so any int8 rounding near a tie flips the argmax (and whole sampled
# sequences). Top-1 agreement measured 0.888-0.96 across CPUs (int8 kernels
# differ by instruction set); the full-size random checkpoint uses 0.85 too
# (docs/quantization.md). The cosine, SNR and structure checks keep the default.
TINY_BUDGET = AccuracyBudget(e2e_match_min=0.0, llm_top1_min=0.85)
QUANT_STAGES = ("llm_prefill", "llm_decode", "flow_estimator", "hift_decoder")


def _settings(precision: str, **kw: Any) -> QuantizeSettings:
    base: dict[str, Any] = dict(precision=precision, calibration_size=4, held_out_size=2, feeds_per_stage=12,
                                budget=TINY_BUDGET)
    base.update(kw)
    return QuantizeSettings(**base)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def int8_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    before = _digest(tiny_bundle / "manifest.json")
    listing = sorted(p.name for p in tiny_bundle.iterdir())
    out = tmp_path_factory.mktemp("q") / "b8"
    report = quantize_bundle(tiny_bundle, out, _settings("int8"))
    assert _digest(tiny_bundle / "manifest.json") == before, "the source bundle's manifest was modified"
    assert sorted(p.name for p in tiny_bundle.iterdir()) == listing
    return out, report


@pytest.fixture(scope="module")
def fp16_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("q") / "b16"
    return out, quantize_bundle(tiny_bundle, out, _settings("fp16"))


@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_bundle_loads_and_synthesizes(precision: str, int8_bundle: Any, fp16_bundle: Any) -> None:
    out, _ = int8_bundle if precision == "int8" else fp16_bundle
    for settings in (SynthesisSettings(), SynthesisSettings(precision=precision)):
        engine = load_synthesizer(out, settings=settings)
        try:
            assert engine.bundle.precision == precision
            for stage in QUANT_STAGES:
                assert engine.bundle.stages[stage].path.name == f"{stage}.{precision}.onnx"
            assert engine.bundle.stages["hift_source"].path.name == "hift_source.onnx"
            chunks = list(engine.synthesize(SynthesisRequest(text="Hello world, 你好。", stream=True, seed=3)))
            # the streaming flow caches: fp16 graphs take the K/V cache in fp16
            want = np.float16 if precision == "fp16" else np.float32
            assert engine.flow.cache_dtype == want
            stream = engine.flow.stream(engine.conditioning.build(SynthesisRequest(text="x")).flow, "cached")
            toks = np.arange(120) % engine.bundle.llm.speech_token_size
            mel = np.concatenate([stream.push(toks[:n]) for n in (28, 53, 78)] + [stream.finish(toks)], axis=2)
            assert mel.shape[2] == 240 and np.isfinite(mel).all()
            assert stream.committed >= 100 and stream.caches[0].kv.dtype == want
        finally:
            engine.close()
        pcm = np.concatenate([c.pcm for c in chunks])
        assert pcm.size > 0 and np.isfinite(pcm).all() and np.abs(pcm).max() > 0
        assert chunks[-1].last


@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_report_meets_budget(precision: str, int8_bundle: Any, fp16_bundle: Any) -> None:
    out, report = int8_bundle if precision == "int8" else fp16_bundle
    saved = json.loads((out / REPORT_FILE).read_text())
    m, b = saved["metrics"], saved["budget"]
    assert saved["failed"] == [] and not saved["forced"]
    assert m["llm_cosine"] >= b["llm_cosine_min"] and m["llm_top1"] >= b["llm_top1_min"]
    assert m["mel_snr_db"] >= b["mel_snr_min_db"] and m["wav_snr_db"] >= b["wav_snr_min_db"]
    assert 0.0 <= m["e2e_match"] <= 1.0
    assert set(saved["held_out_texts"]).isdisjoint(calibration_texts(len(calibration_texts(16))))
    for stage, sizes in saved["sizes"].items():
        assert sizes["variant_bytes"] < sizes["fp32_bytes"], stage
    if precision == "fp16":  # the overflow check the build ran, per stage
        checks = {stage: c for u in saved["units"] for stage, c in u["finite_check"]["stages"].items()}
        assert set(checks) == set(QUANT_STAGES)
        assert all(c["inputs"] > 0 and c["nonfinite_inputs"] == 0 for c in checks.values())
        decode = checks["llm_decode"]
        assert decode["fp32_ops"].get("ReduceMean", 0) > 0 and "Softmax" in decode["fp16_ops"]


def test_sensitivity_table_and_fp32_nodes(int8_bundle: Any) -> None:
    out, report = int8_bundle
    manifest = json.loads((out / "manifest.json").read_text())
    units = {u["unit"]: u for u in report["units"]}
    assert set(units) == {"llm", "flow", "vocoder"}
    for unit in units.values():
        groups = {row["group"] for row in unit["sensitivity"]}
        assert groups and groups <= set(unit["groups"])
    assert "time_embedding" in units["flow"]["excluded_groups"] and "stft" in units["vocoder"]["excluded_groups"]
    for stage in QUANT_STAGES:
        variant = manifest["stages"][stage]["variants"]["int8"]
        model = onnx.load(str(out / variant["file"]))
        names = {n.name: n.op_type for n in model.graph.node}
        assert set(variant["fp32_nodes"]) <= set(names)
        # Normalization/softmax are pinned; excluded quantizable nodes run without Q/DQ.
        pinned_ops = {names[n] for n in variant["fp32_nodes"]}
        assert pinned_ops & {"LayerNormalization", "Softmax", "ReduceMean", "Sin"}, stage
        # The TensorRT builder's reading of the variant: strongly typed from the Q/DQ graph, the
        # fp32 nodes fp32 in the graph itself (no Q/DQ on them).
        mode = precision_mode(model, variant["fp32_nodes"])
        assert mode.strongly_typed and mode.carried_by == "Q/DQ" and mode.fp32_nodes
        dq_out = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
        fed_by_dq = [n.name for n in model.graph.node if n.name in variant["fp32_nodes"] and set(n.input) & dq_out]
        assert not fed_by_dq, f"{stage}: TensorRT would fuse these fp32 nodes' DequantizeLinear into INT8"
    flow = json.loads((out / "manifest.json").read_text())["stages"]["flow_estimator"]["variants"]["int8"]
    assert "/time_mlp/linear_1/Gemm" in flow["fp32_nodes"]
    assert manifest["stages"]["hift_source"]["variants"]["int8"]["precision"] == "fp32"


def test_int8_graphs_follow_tensorrt_qdq_rules(int8_bundle: Any) -> None:
    out, _ = int8_bundle
    for stage in QUANT_STAGES:
        model = onnx.load(str(out / f"{stage}.int8.onnx"))
        assert sum(n.op_type == "DequantizeLinear" for n in model.graph.node) > 0
        assert check_qdq(model) == [], stage


def test_qdq_checker_rejects_broken_graphs(int8_bundle: Any) -> None:
    out, _ = int8_bundle
    path = out / "llm_prefill.int8.onnx"

    def broken(edit: Any) -> list[str]:
        model = onnx.load(str(path))
        edit(model)
        return check_qdq(model)

    def nonzero_zero_point(model: onnx.ModelProto) -> None:
        dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
        init = next(t for t in model.graph.initializer if t.name == dq.input[2])
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + np.int8(1), init.name))

    def weight_without_dq(model: onnx.ModelProto) -> None:
        mm = next(n for n in model.graph.node if n.name == "/q_proj/MatMul")
        model.graph.initializer.append(numpy_helper.from_array(np.ones((4, 4), np.float32), "plain_w"))
        mm.input[1] = "plain_w"

    def wrong_axis(model: onnx.ModelProto) -> None:
        producer = {o: n for n in model.graph.node for o in n.output}
        mm = next(n for n in model.graph.node if n.name == "/q_proj/MatMul")
        dq = producer[mm.input[1]]
        kept = [a for a in dq.attribute if a.name != "axis"]
        del dq.attribute[:]
        dq.attribute.extend([*kept, onnx.helper.make_attribute("axis", 0)])

    def negative_scale(model: onnx.ModelProto) -> None:
        q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear")
        init = next(t for t in model.graph.initializer if t.name == q.input[1])
        init.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(init), init.name))

    assert any("zero points must be 0" in p for p in broken(nonzero_zero_point))
    assert any("lacks DequantizeLinear" in p for p in broken(weight_without_dq))
    assert any("output-channel axis" in p for p in broken(wrong_axis))
    assert any("positive" in p for p in broken(negative_scale))


def test_fp16_stages_have_no_nan_on_calibration_inputs(tiny_bundle: Path, fp16_bundle: Any) -> None:
    out, _ = fp16_bundle
    feeds = capture_feeds(tiny_bundle, calibration_texts(4), cap_per_stage=12).feeds
    for stage in QUANT_STAGES:
        assert feeds[stage]
        for result in _outputs(out / f"{stage}.fp16.onnx", feeds[stage]):
            assert np.isfinite(result).all(), stage


def test_strict_budget_is_refused_unless_forced(tiny_bundle: Path, tmp_path: Path) -> None:
    strict = AccuracyBudget(mel_snr_min_db=500.0, e2e_match_min=0.0)
    out = tmp_path / "strict"
    with pytest.raises(QuantizeBudgetError, match="flow: mel SNR") as info:
        quantize_bundle(tiny_bundle, out, _settings("fp16", budget=strict, held_out_size=1))
    assert not out.exists() and not list(tmp_path.iterdir())
    assert info.value.failed and all(f.startswith("flow") for f in info.value.failed)
    report = quantize_bundle(tiny_bundle, out, _settings("fp16", budget=strict, held_out_size=1, force=True))
    assert report["forced"] and json.loads((out / REPORT_FILE).read_text())["failed"]


def test_end_to_end_gate_refuses_a_bundle(tiny_bundle: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`build quantize` with an end-to-end floor the tiny bundle cannot reach: int8 weights on
    random weights flip near-tied tokens, so the seeded sequences part before their end (a
    matched fraction below 1); every per-stage gate is left open, so the end-to-end gate alone
    refuses, names itself, exits 2 and writes nothing."""
    from cosyedge_daemon.cli.main import main

    out = tmp_path / "refused"
    rc = main(["build", "quantize", "--bundle", str(tiny_bundle), "--out", str(out), "--precision", "int8w",
               "--held-out-size", "2", "--feeds-per-stage", "4", "--min-llm-cosine", "0", "--min-llm-top1", "0",
               "--min-mel-snr-db", "-1000", "--min-wav-snr-db", "-1000", "--min-e2e-match", "1.0"])
    captured = capsys.readouterr()
    assert rc == 2, captured.out + captured.err
    failed = re.search(r"misses the accuracy budget \((.*)\); nothing was written", captured.err)
    assert failed is not None, captured.err
    reason = failed.group(1)
    match = re.fullmatch(r"end-to-end: matched token fraction (\S+) < 1", reason)
    assert match is not None, reason  # the end-to-end gate, and only it
    assert 0.0 <= float(match.group(1)) < 1.0
    assert not out.exists() and not list(tmp_path.iterdir())


def test_feed_store_caps_and_keeps_late_feeds() -> None:
    store = FeedStore(cap=4, seed=1)
    for i in range(100):
        store.add("llm_decode", {"x": np.array([i])})
    kept = [int(f["x"][0]) for f in store.feeds["llm_decode"]]
    assert len(kept) == 4 and store.seen["llm_decode"] == 100 and max(kept) >= 4


def test_metrics() -> None:
    assert matched_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert matched_prefix([1, 2], [1, 2]) == 1.0
    assert matched_prefix([1, 2], [1, 2, 3]) == pytest.approx(2 / 3)
    x = np.sin(np.arange(1000.0))
    assert snr_db(x, x + 0.01 * x) == pytest.approx(40.0)
    assert len(set(HELD_OUT_TEXTS) & set(calibration_texts(40))) == 0


def test_prefill_and_decode_share_int8_weights(int8_bundle: Any) -> None:
    out, _ = int8_bundle
    graphs = [onnx.load(str(out / f"{s}.int8.onnx")) for s in ("llm_prefill", "llm_decode")]

    def weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
        return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
                if t.data_type == onnx.TensorProto.INT8 and t.dims and len(t.dims) == 2}

    a, b = (weights(g) for g in graphs)
    assert a and len(a) == len(b)
    # Same checkpoint weights -> the same int8 tensors (names may differ between the exports).
    key = sorted(a.values(), key=lambda w: (w.shape, w.tobytes()))
    other = sorted(b.values(), key=lambda w: (w.shape, w.tobytes()))
    assert all(np.array_equal(x, y) for x, y in zip(key, other, strict=True))


def test_cli_arguments_and_table(int8_bundle: Any) -> None:
    import argparse

    from cosyedge_daemon.cli.build_quantize import add_quantize_arguments, format_report, settings_from_args

    p = argparse.ArgumentParser()
    add_quantize_arguments(p)
    args = p.parse_args(["--bundle", "B", "--out", "B8", "--precision", "fp16", "--calibration-size", "5",
                         "--min-mel-snr-db", "30", "--force"])
    s = settings_from_args(args)
    assert (s.precision, s.calibration_size, s.budget.mel_snr_min_db, s.force) == ("fp16", 5, 30.0, True)
    with pytest.raises(SystemExit):
        p.parse_args(["--bundle", "B", "--out", "B8", "--precision", "int4"])
    table = format_report(int8_bundle[1])
    assert "llm logits cosine" in table and "sensitivity flow" in table and "FAIL" not in table


def test_sensitivity_pass_excludes_worst_groups_until_budget(tiny_bundle: Path, tmp_path: Path) -> None:
    from cosyedge_build.quantize.policy import unit
    from cosyedge_build.quantize.sensitivity import quantize_unit

    vocoder = unit("vocoder")
    calib = capture_feeds(tiny_bundle, calibration_texts(2), cap_per_stage=6).feeds
    held = capture_feeds(tiny_bundle, list(HELD_OUT_TEXTS[:1]), cap_per_stage=6, seed=5).feeds
    loose = quantize_unit(vocoder, tiny_bundle, tmp_path, calib, held, AccuracyBudget(wav_snr_min_db=0.0),
                          "minmax", tmp_path)
    assert loose.excluded_groups == ["stft"] and loose.within_budget
    assert not list(tmp_path.glob("*.only-*"))  # each trial graph is deleted once measured
    assert loose.paths["hift_decoder"].exists()
    target = loose.metrics["snr_db"] + 3.0  # stricter than "everything quantized" reaches
    strict = quantize_unit(vocoder, tiny_bundle, tmp_path, calib, held, AccuracyBudget(wav_snr_min_db=target),
                           "minmax", tmp_path)
    worst = min(strict.table, key=lambda r: float(r["snr_db"]))  # type: ignore[arg-type]
    assert strict.excluded_groups[:2] == ["stft", worst["group"]]
    assert strict.metrics["snr_db"] > loose.metrics["snr_db"]
    assert strict.within_budget == (strict.metrics["snr_db"] >= target)
    model = onnx.load(str(strict.paths["hift_decoder"]))
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        if node.name in strict.excluded_nodes:
            assert all(producer.get(i) != "DequantizeLinear" for i in node.input), node.name


@pytest.fixture(scope="module")
def int8w_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("q") / "b8w"
    return out, quantize_bundle(tiny_bundle, out, _settings("int8w"))


def test_weight_only_int8_bundle(int8w_bundle: Any) -> None:
    """int8w: MatMulNBits (8-bit) in place of every constant-weight MatMul of the
    LLM and the flow estimator, within the budget, smaller, and it speaks."""
    out, report = int8w_bundle
    assert report["failed"] == [] and report["calibration"]["feeds"] == {}
    m = report["metrics"]
    assert m["llm_cosine"] >= TINY_BUDGET.llm_cosine_min and m["mel_snr_db"] >= TINY_BUDGET.mel_snr_min_db
    manifest = json.loads((out / "manifest.json").read_text())
    units = {u["unit"]: u for u in report["units"]}
    for stage in ("llm_prefill", "llm_decode", "flow_estimator"):
        variant = manifest["stages"][stage]["variants"]["int8w"]
        assert variant["file"] == f"{stage}.int8w.onnx" and variant["precision"] == "int8w"
        model = onnx.load(str(out / variant["file"]))
        ops = [n.op_type for n in model.graph.node]
        assert ops.count("MatMulNBits") == units["llm" if stage.startswith("llm") else "flow"]["matmul_nbits"][stage]
        assert ops.count("MatMulNBits") > 0
        # time embedding kept fp32: its MatMuls (if any) were excluded by name
        assert not any(n.op_type == "MatMulNBits" and re.search(r"time_mlp|time_emb", n.name)
                       for n in model.graph.node)
        assert report["sizes"][stage]["variant_bytes"] < report["sizes"][stage]["fp32_bytes"]
    engine = load_synthesizer(out, settings=SynthesisSettings(precision="int8w"))
    try:
        assert engine.bundle.stages["llm_decode"].path.name == "llm_decode.int8w.onnx"
        chunks = list(engine.synthesize(SynthesisRequest(text="Hello world, 你好。", stream=True, seed=3)))
    finally:
        engine.close()
    pcm = np.concatenate([c.pcm for c in chunks])
    assert pcm.size > 0 and np.isfinite(pcm).all() and chunks[-1].last


def test_engines_refuse_weight_only_bundle(int8w_bundle: Any) -> None:
    from cosyedge_build.tensorrt.engines import build_engines
    from cosyedge_models.errors import BundleError

    out, _ = int8w_bundle
    with pytest.raises(BundleError, match=r"not int8w \(an onnxruntime-only format\); pass --precision int8 or fp16"):
        build_engines(out)


def test_daemon_cli_offers_every_precision() -> None:
    """daemon/cli/main.py declares the quantize options itself (the board's CLI must not
    import the build side); it must offer what the quantizer takes."""
    from cosyedge_build.quantize.settings import PRECISIONS
    from cosyedge_daemon.cli.main import build_parser

    parser = build_parser()
    for precision in PRECISIONS:
        args = parser.parse_args(["build", "quantize", "--bundle", "B", "--out", "O", "--precision", precision])
        assert args.precision == precision
    with pytest.raises(SystemExit):
        parser.parse_args(["build", "quantize", "--bundle", "B", "--out", "O", "--precision", "int4"])


def test_int8_report_carries_memory_and_llm_weights_are_shared_once(int8_bundle: Any) -> None:
    out, report = int8_bundle
    memory = report["memory"]
    assert memory["peak_rss_bytes"] > 0 and memory["estimate"]["peak_bytes"] > 0
    assert set(memory["peak_rss_after_bytes"]) >= {"capture", "unit llm", "accuracy_report"}
    index = json.loads((out / "llm_weights.int8.json").read_text())
    assert sorted(index["graphs"]) == ["llm_decode.int8.onnx", "llm_prefill.int8.onnx"]
    for graph in index["graphs"]:
        model = onnx.load(str(out / graph), load_external_data=False)
        external = {t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
        assert external == set(index["tensors"])  # both graphs use every shared tensor: one copy for the two
