"""The sensitivity pass: quantize one node group at a time, measure the
stage's output error on held-out feeds, then exclude the worst groups until
the stage meets its budget."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from cosyedge_build.quantize.capture import Feed
from cosyedge_build.quantize.int8 import quantize_int8
from cosyedge_build.quantize.metrics import logits_cosine, snr_db, top1_agreement
from cosyedge_build.quantize.policy import UnitPolicy, groups_in
from cosyedge_build.quantize.settings import AccuracyBudget
from cosyedge_models.tools.progress import StageProgress

log = logging.getLogger(__name__)


def _session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def _outputs(path: Path, feeds: Sequence[Feed]) -> list[np.ndarray]:
    sess = _session(path)
    # fp16 I/O (FP16_IO) gets the captured fp32 feeds cast, as the runtime keeps them in fp16
    types = {i.name: (np.float16 if i.type == "tensor(float16)" else None) for i in sess.get_inputs()}
    out = sess.get_outputs()[0].name

    def feed(f: Feed) -> Feed:
        return {k: (v.astype(t) if (t := types[k]) is not None else v) for k, v in f.items() if k in types}

    return [sess.run([out], feed(f))[0] for f in feeds]


def stage_metrics(unit: UnitPolicy, reference: dict[str, list[np.ndarray]], paths: dict[str, Path],
                  feeds: Mapping[str, Sequence[Feed]]) -> dict[str, float]:
    """The unit's error on `feeds` against the fp32 outputs `reference`."""
    if unit.name == "llm":
        cos, top1 = [], []
        for stage in unit.stages:
            for ref, test in zip(reference[stage], _outputs(paths[stage], feeds[stage]), strict=True):
                cos.extend(logits_cosine(ref, test).tolist())
                top1.append(top1_agreement(ref, test))
        return {"cosine": float(np.mean(cos)), "top1": float(np.mean(top1))}
    snrs = []
    for stage in unit.stages:
        for ref, test in zip(reference[stage], _outputs(paths[stage], feeds[stage]), strict=True):
            snrs.append(snr_db(ref, test))
    # Identical outputs give +inf; cap so that the mean stays meaningful.
    return {"snr_db": float(np.mean([min(v, 200.0) for v in snrs]))}


def within_budget(unit: UnitPolicy, metrics: dict[str, float], budget: AccuracyBudget) -> bool:
    if unit.name == "llm":
        return metrics["cosine"] >= budget.llm_cosine_min and metrics["top1"] >= budget.llm_top1_min
    floor = budget.mel_snr_min_db if unit.name == "flow" else budget.wav_snr_min_db
    return metrics["snr_db"] >= floor


def badness(unit: UnitPolicy, metrics: dict[str, float]) -> float:
    """Larger is worse; orders groups for exclusion."""
    if unit.name == "llm":
        return (1.0 - metrics["cosine"]) + (1.0 - metrics["top1"]) * 0.1
    return -metrics["snr_db"]


@dataclass
class UnitResult:
    unit: str
    groups: dict[str, int]  # group -> quantizable nodes
    table: list[dict[str, object]] = field(default_factory=list)  # one row per group quantized alone
    excluded_groups: list[str] = field(default_factory=list)
    excluded_nodes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    within_budget: bool = False
    paths: dict[str, Path] = field(default_factory=dict)


def _remove(paths: Iterable[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".data").unlink(missing_ok=True)


def quantize_unit(unit: UnitPolicy, bundle: Path, work: Path, calib: Mapping[str, Sequence[Feed]],
                  held_out: Mapping[str, Sequence[Feed]], budget: AccuracyBudget, method: str, out_dir: Path,
                  progress: StageProgress | None = None) -> UnitResult:
    """Quantize the unit's graphs; the chosen ones end up as out_dir/<stage>.int8.onnx."""
    models = {s: onnx.load(str(bundle / f"{s}.onnx"), load_external_data=False) for s in unit.stages}
    groups: dict[str, list[str]] = {}
    for model in models.values():  # prefill and decode share node names; union keeps them consistent
        for g, names in groups_in(unit, model).items():
            groups.setdefault(g, [])
            groups[g].extend(n for n in names if n not in groups[g])
    reference = {s: _outputs(bundle / f"{s}.onnx", held_out[s]) for s in unit.stages}
    result = UnitResult(unit.name, {g: len(n) for g, n in groups.items()})

    def build(excluded_groups: Sequence[str], tag: str) -> tuple[dict[str, Path], list[str]]:
        exclude = [n for g in excluded_groups for n in groups.get(g, [])]
        paths = {}
        for s in unit.stages:
            # The final graphs are written in place (big ones carry external data named after them).
            paths[s] = out_dir / f"{s}.int8.onnx" if tag == "final" else work / f"{s}.{tag}.int8.onnx"
            # one calibration per graph: every build reuses its ranges
            quantize_int8(bundle / f"{s}.onnx", paths[s], calib[s], exclude, method, work / f"{s}.ranges.json")
        if progress is not None:
            progress.advance(f"{unit.name} {tag}")
        return paths, exclude

    candidates = [g for g in groups if g not in unit.always_fp32]
    for g in candidates:
        paths, _ = build([h for h in groups if h != g], f"only-{g}")
        m = stage_metrics(unit, reference, paths, held_out)
        _remove(paths.values())  # a trial graph is measured once (full size: 1.4 GB per LLM graph)
        result.table.append({"group": g, "nodes": len(groups[g]), **m})
        log.info("%s: %s alone -> %s", unit.name, g, m)
    ranked = sorted(result.table, key=lambda r: -badness(unit, {k: float(v) for k, v in r.items()  # type: ignore[arg-type]
                                                                 if k not in ("group", "nodes")}))
    excluded = list(unit.always_fp32)
    while True:
        paths, nodes = build(excluded, "final")
        metrics = stage_metrics(unit, reference, paths, held_out)
        ok = within_budget(unit, metrics, budget)
        remaining = [str(r["group"]) for r in ranked if str(r["group"]) not in excluded]
        if ok or not remaining:
            break
        log.info("%s: %s over budget; keeping %s in fp32", unit.name, metrics, remaining[0])
        excluded.append(remaining[0])
    result.excluded_groups = [g for g in excluded if g in groups]
    result.excluded_nodes = nodes
    result.metrics = metrics
    result.within_budget = ok
    result.paths = paths
    return result
