"""`cosyedge build quantize`: calibrate, quantize (int8) or convert (fp16),
check against the accuracy budget, write the bundle."""

from __future__ import annotations

import gc
import json
import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
from cosyedge_build.export.shared_weights import share_llm_files
from cosyedge_build.quantize.accuracy import compare_bundles, failures
from cosyedge_build.quantize.capture import Feed, capture_feeds
from cosyedge_build.quantize.companions import (
    add_companion_variants,
    always_fp32_nodes,
    convert_companions,
    fp16_io,
)
from cosyedge_build.quantize.finite import failures as finite_failures
from cosyedge_build.quantize.finite import finite_check
from cosyedge_build.quantize.fp16 import convert_fp16
from cosyedge_build.quantize.memory import (
    GIB,
    MemoryEstimate,
    available_bytes,
    check_fits,
    estimate_peak,
    graph_bytes,
    peak_rss_bytes,
)
from cosyedge_build.quantize.policy import UNITS, fp32_node_names
from cosyedge_build.quantize.sensitivity import _outputs, quantize_unit, stage_metrics
from cosyedge_build.quantize.settings import QuantizeSettings
from cosyedge_build.quantize.texts import HELD_OUT_TEXTS, calibration_texts
from cosyedge_build.quantize.weight_only import quantize_weight_only
from cosyedge_build.quantize.writer import add_variants, link_bundle
from cosyedge_models.backends.shared_weights import graph_shared_bytes, shared_bytes
from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.errors import CosyEdgeError
from cosyedge_models.tools.progress import StageProgress

log = logging.getLogger(__name__)
REPORT_FILE = "quantize_report.json"


class QuantizeBudgetError(CosyEdgeError):
    """The low-precision bundle misses the accuracy budget; nothing was written."""

    def __init__(self, failed: list[str], report: dict[str, Any]) -> None:
        super().__init__("the quantized bundle misses the accuracy budget (" + "; ".join(failed)
                         + "); nothing was written. Relax the budget, keep more layers in fp32, "
                           "or pass --force to write it anyway")
        self.failed = failed
        self.report = report


def quantize_bundle(src: Path, out: Path, settings: QuantizeSettings) -> dict[str, Any]:
    """Write `out` (which must not exist) and return the report."""
    src, out = Path(src), Path(out)
    source = load_bundle(src, precision="fp32")  # a clear error for a bad source bundle
    if out.exists() and any(out.iterdir()):
        raise CosyEdgeError(f"{out} exists and is not empty; choose a new --out directory")
    estimate = _estimate(src, source.manifest, settings.precision)
    check_fits(estimate, available_bytes(), settings.max_memory_bytes)
    log.info("quantize: estimated peak %.1f GiB (%s)", estimate.peak_bytes / GIB, estimate.peak_phase)
    held_texts = list(HELD_OUT_TEXTS[: settings.held_out_size])
    calib_texts = calibration_texts(settings.calibration_size)
    started = time.perf_counter()
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    link_bundle(src, tmp)
    work = tmp / ".work"
    work.mkdir()
    peaks: dict[str, int] = {}
    # Weight-only int8 needs no activation ranges: no calibration run.
    n_calib = 0 if settings.precision == "int8w" else len(calib_texts)
    steps = n_calib + len(held_texts) + sum(len(u.groups) + 1 for u in UNITS) + 1
    progress = StageProgress(f"quantize {settings.precision}", steps)
    try:
        calib: Mapping[str, Sequence[Feed]] = {}
        if n_calib:
            calib = capture_feeds(src, calib_texts, settings.feeds_per_stage, settings.seed, work / "calibration",
                                  lambda i: progress.advance(f"calibration text {i + 1}/{n_calib}")).feeds
        held = capture_feeds(src, held_texts, settings.feeds_per_stage, settings.seed + 7919, work / "held_out",
                             lambda i: progress.advance(f"held-out text {i + 1}/{len(held_texts)}")).feeds
        gc.collect()
        peaks["capture"] = peak_rss_bytes()
        units: list[dict[str, Any]] = []
        files: dict[str, Path] = {}
        fp32_nodes: dict[str, list[str]] = {}
        for unit in UNITS:
            if settings.precision == "int8":
                res = quantize_unit(unit, src, work, calib, held, settings.budget, settings.calibration_method, tmp,
                                    progress)
                for stage, path in res.paths.items():
                    files[stage] = path
                    fp32_nodes[stage] = fp32_node_names(onnx.load(str(path), load_external_data=False),
                                                        res.excluded_nodes)
                units.append({"unit": unit.name, "groups": res.groups, "sensitivity": res.table,
                              "excluded_groups": res.excluded_groups, "stage_metrics": res.metrics,
                              "stage_within_budget": res.within_budget})
            elif settings.precision == "int8w":
                units.append(_weight_only_unit(unit, src, tmp, held, files))
            else:
                units.append(_fp16_unit(unit, src, tmp, calib, held, files))
            gc.collect()  # the unit's models and sessions go before the next unit's load
            peaks[f"unit {unit.name}"] = peak_rss_bytes()
            progress.advance(f"unit {unit.name}")
        extra = convert_companions(src, tmp, settings.precision, files)
        # one copy of the low-precision LLM weights, as for fp32
        share_llm_files(tmp, {**files, **extra}, f"llm_weights.{settings.precision}.bin")
        add_variants(tmp, settings.precision, files, fp32_nodes, REPORT_FILE)
        add_companion_variants(tmp, settings.precision, extra)
        metrics = compare_bundles(src, tmp, settings.precision, held_texts, settings.seed)
        peaks["accuracy_report"] = peak_rss_bytes()
        progress.advance("accuracy report")
        failed = failures(metrics, settings.budget)
        report = {
            "precision": settings.precision, "source": str(src), "metrics": metrics, "failed": failed,
            "budget": settings.budget.__dict__, "units": units, "sizes": _sizes(src, files),
            "calibration": {"texts": settings.calibration_size, "method": settings.calibration_method,
                            "feeds": {k: len(v) for k, v in calib.items()}},
            "memory": {"estimate": estimate.as_dict(), "peak_rss_bytes": peak_rss_bytes(),
                       "peak_rss_after_bytes": peaks, "available_bytes_at_start": available_bytes()},
            "held_out_texts": held_texts, "forced": bool(failed) and settings.force,
            "seconds": round(time.perf_counter() - started, 1),
        }
        shutil.rmtree(work)
        if failed and not settings.force:
            raise QuantizeBudgetError(failed, report)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2, default=float) + "\n")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        progress.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _estimate(src: Path, manifest: Mapping[str, Any], precision: str) -> MemoryEstimate:
    stages = {name: entry for name, entry in manifest.get("stages", {}).items() if "file" in entry}
    llm_files = [e["file"] for name, e in stages.items() if name.startswith("llm_")]
    uses = graph_shared_bytes(src)
    # a graph's full size (what the quantizer loads): its file, its own data and the shared weights it uses
    sizes = {name: graph_bytes(src / e["file"]) + uses.get(e["file"], 0) for name, e in stages.items()}
    quantized = [s for u in UNITS for s in u.stages]
    return estimate_peak(sizes, quantized, precision, sum(shared_bytes(src, llm_files).values()))


def _fp16_unit(unit: Any, src: Path, tmp: Path, calib: Mapping[str, Sequence[Feed]],
               held: Mapping[str, Sequence[Feed]],
               files: dict[str, Path]) -> dict[str, Any]:
    """fp16 graphs of one unit; the always-fp32 groups stay fp32. Refuses a
    graph that gives NaN/Inf on any calibration input."""
    paths = {}
    manifest = json.loads((src / "manifest.json").read_text())
    for stage in unit.stages:
        block = always_fp32_nodes(unit, src / f"{stage}.onnx")
        paths[stage] = tmp / f"{stage}.fp16.onnx"
        convert_fp16(src / f"{stage}.onnx", paths[stage], block, fp16_io(stage, manifest))
    check = finite_check(paths, calib)  # every output on every calibration input (CPU)
    if not check["ok"]:
        raise CosyEdgeError("the fp16 graphs are not finite on the calibration set; not writing them: "
                            + "; ".join(finite_failures(check)))
    files.update(paths)
    return {**_unit_report(unit, src, paths, held), "finite_check": check}


def _weight_only_unit(unit: Any, src: Path, tmp: Path, held: Mapping[str, Sequence[Feed]],
                      files: dict[str, Path]) -> dict[str, Any]:
    """Weight-only int8 graphs of one unit; the always-fp32 groups stay fp32."""
    paths = {}
    counts = {}
    for stage in unit.stages:
        exclude = always_fp32_nodes(unit, src / f"{stage}.onnx")
        paths[stage] = tmp / f"{stage}.int8w.onnx"
        counts[stage] = quantize_weight_only(src / f"{stage}.onnx", paths[stage], exclude)
        if counts[stage] == 0:  # no MatMul with a constant weight (the vocoder is convolutions): keep fp32
            paths.pop(stage).unlink()
            continue
        files[stage] = paths[stage]
    if not paths:
        return {"unit": unit.name, "matmul_nbits": counts, "note": "kept in fp32: no MatMul weights"}
    return {**_unit_report(unit, src, paths, held), "matmul_nbits": counts}


def _unit_report(unit: Any, src: Path, paths: dict[str, Path], held: Mapping[str, Sequence[Feed]]) -> dict[str, Any]:
    """The unit's error on the held-out feeds against its fp32 graphs."""
    reference = {s: _outputs(src / f"{s}.onnx", held[s]) for s in paths}
    return {"unit": unit.name, "stage_metrics": stage_metrics(unit, reference, paths, held),
            "blocked_groups": list(unit.always_fp32)}


def _sizes(src: Path, files: dict[str, Path]) -> dict[str, dict[str, int]]:
    shared = {**graph_shared_bytes(src), **graph_shared_bytes(next(iter(files.values())).parent)} if files else {}

    def size(p: Path) -> int:  # with the shared weights it uses (counted for each graph: what it holds)
        data = p.with_name(p.name + ".data")
        return p.stat().st_size + (data.stat().st_size if data.exists() else 0) + shared.get(p.name, 0)

    return {stage: {"fp32_bytes": size(src / f"{stage}.onnx"), "variant_bytes": size(path)}
            for stage, path in files.items()}
