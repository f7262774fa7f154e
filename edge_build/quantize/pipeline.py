"""`cosyedge build quantize`: calibrate, quantize (int8) or convert (fp16),
check against the accuracy budget, write the bundle."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from cosyedge_build.quantize.accuracy import compare_bundles, failures
from cosyedge_build.quantize.capture import capture_feeds
from cosyedge_build.quantize.fp16 import FP16_IO, convert_fp16
from cosyedge_build.quantize.policy import UNITS, fp32_node_names, groups_in
from cosyedge_build.quantize.sensitivity import _outputs, quantize_unit, stage_metrics
from cosyedge_build.quantize.settings import QuantizeSettings
from cosyedge_build.quantize.texts import HELD_OUT_TEXTS, calibration_texts
from cosyedge_build.quantize.weight_only import quantize_weight_only
from cosyedge_build.quantize.writer import add_variants, link_bundle
from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.errors import CosyEdgeError

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
    load_bundle(src, precision="fp32")  # a clear error for a bad source bundle
    if out.exists() and any(out.iterdir()):
        raise CosyEdgeError(f"{out} exists and is not empty; choose a new --out directory")
    held_texts = list(HELD_OUT_TEXTS[: settings.held_out_size])
    started = time.perf_counter()
    # Weight-only int8 needs no activation ranges: no calibration run.
    calib = {} if settings.precision == "int8w" else capture_feeds(
        src, calibration_texts(settings.calibration_size), settings.feeds_per_stage, settings.seed).feeds
    held = capture_feeds(src, held_texts, settings.feeds_per_stage, settings.seed + 7919).feeds
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    link_bundle(src, tmp)
    work = tmp / ".work"
    work.mkdir()
    units: list[dict[str, Any]] = []
    files: dict[str, Path] = {}
    fp32_nodes: dict[str, list[str]] = {}
    try:
        for unit in UNITS:
            if settings.precision == "int8":
                res = quantize_unit(unit, src, work, calib, held, settings.budget, settings.calibration_method, tmp)
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
        add_variants(tmp, settings.precision, files, fp32_nodes, REPORT_FILE)
        metrics = compare_bundles(src, tmp, settings.precision, held_texts, settings.seed)
        failed = failures(metrics, settings.budget)
        report = {
            "precision": settings.precision, "source": str(src), "metrics": metrics, "failed": failed,
            "budget": settings.budget.__dict__, "units": units, "sizes": _sizes(src, files),
            "calibration": {"texts": settings.calibration_size, "method": settings.calibration_method,
                            "feeds": {k: len(v) for k, v in calib.items()}},
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
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _fp16_unit(unit: Any, src: Path, tmp: Path, calib: dict[str, list[Any]], held: dict[str, list[Any]],
               files: dict[str, Path]) -> dict[str, Any]:
    """fp16 graphs of one unit; the always-fp32 groups stay fp32. Refuses a
    graph that gives NaN/Inf on any calibration input."""
    paths = {}
    for stage in unit.stages:
        block = _always_fp32_nodes(unit, src / f"{stage}.onnx")
        paths[stage] = tmp / f"{stage}.fp16.onnx"
        convert_fp16(src / f"{stage}.onnx", paths[stage], block, FP16_IO.get(stage, ()))
        bad = sum(not np.isfinite(o).all() for o in _outputs(paths[stage], calib[stage]))
        if bad:
            raise CosyEdgeError(f"{stage}: the fp16 graph gives NaN/Inf on {bad} of {len(calib[stage])} "
                                "calibration inputs; not writing it")
        files[stage] = paths[stage]
    return _unit_report(unit, src, paths, held)


def _weight_only_unit(unit: Any, src: Path, tmp: Path, held: dict[str, list[Any]],
                      files: dict[str, Path]) -> dict[str, Any]:
    """Weight-only int8 graphs of one unit; the always-fp32 groups stay fp32."""
    paths = {}
    counts = {}
    for stage in unit.stages:
        exclude = _always_fp32_nodes(unit, src / f"{stage}.onnx")
        paths[stage] = tmp / f"{stage}.int8w.onnx"
        counts[stage] = quantize_weight_only(src / f"{stage}.onnx", paths[stage], exclude)
        if counts[stage] == 0:  # no MatMul with a constant weight (the vocoder is convolutions): keep fp32
            paths.pop(stage).unlink()
            continue
        files[stage] = paths[stage]
    if not paths:
        return {"unit": unit.name, "matmul_nbits": counts, "note": "kept in fp32: no MatMul weights"}
    return {**_unit_report(unit, src, paths, held), "matmul_nbits": counts}


def _always_fp32_nodes(unit: Any, graph: Path) -> list[str]:
    """The node names of the unit's always-fp32 groups in `graph`."""
    groups = groups_in(unit, onnx.load(str(graph), load_external_data=False))
    return [n for g in unit.always_fp32 for n in groups.get(g, [])]


def _unit_report(unit: Any, src: Path, paths: dict[str, Path], held: dict[str, list[Any]]) -> dict[str, Any]:
    """The unit's error on the held-out feeds against its fp32 graphs."""
    reference = {s: _outputs(src / f"{s}.onnx", held[s]) for s in paths}
    return {"unit": unit.name, "stage_metrics": stage_metrics(unit, reference, paths, held),
            "blocked_groups": list(unit.always_fp32)}


def _sizes(src: Path, files: dict[str, Path]) -> dict[str, dict[str, int]]:
    def size(p: Path) -> int:
        data = p.with_name(p.name + ".data")
        return p.stat().st_size + (data.stat().st_size if data.exists() else 0)

    return {stage: {"fp32_bytes": size(src / f"{stage}.onnx"), "variant_bytes": size(path)}
            for stage, path in files.items()}
