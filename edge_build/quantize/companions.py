"""The optional graphs that follow a unit's stage get the same precision:
the fixed-size decode step follows `llm_decode`, the fixed-shape flow
estimator graphs follow `flow_estimator`, the fixed-shape encoder graphs
`flow_encoder` (kept fp32 in fp16 bundles, as it is). Without them an fp16 or int8w
bundle would run its CUDA-graph paths in fp32, with a second (fp32) copy of
the LLM's weights beside the low-precision one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
from cosyedge_build.quantize.fp16 import FP16_IO, convert_fp16
from cosyedge_build.quantize.policy import UNITS, UnitPolicy, groups_in
from cosyedge_build.quantize.weight_only import quantize_weight_only
from cosyedge_models.bundle.loader import STATIC_ENCODER_PREFIX, STATIC_FLOW_PREFIX, sha256_file

# int8 (Q/DQ) bundles are TensorRT's: its engines take the fixed shapes as
# profiles of the graphs themselves, so the companions stay fp32 there.
COMPANION_PRECISIONS = ("fp16", "int8w")


def base_stage(name: str) -> str | None:
    """The unit stage whose treatment the optional graph `name` follows."""
    if name == "llm_decode_static":
        return "llm_decode"
    if name.startswith(STATIC_FLOW_PREFIX):
        return "flow_estimator"
    if name.startswith(STATIC_ENCODER_PREFIX):
        return "flow_encoder"
    return None


def companions(manifest: dict[str, Any]) -> dict[str, str]:
    """The bundle's optional graphs that follow a stage, with that stage."""
    return {name: base for name in manifest.get("stages", {}) if (base := base_stage(name)) is not None}


def fp16_io(stage: str, manifest: dict[str, Any]) -> tuple[str, ...]:
    """The inputs/outputs an fp16 graph of `stage` keeps in fp16. The
    fixed-shape estimator graphs keep their cache in fp32 (their device
    cache is fp32), and a request moves between them and the dynamic graph
    with one cache, so the dynamic graph keeps an fp32 cache where they exist."""
    if stage == "flow_estimator" and any(b == "flow_estimator" for b in companions(manifest).values()):
        return ()
    return FP16_IO.get(stage, ())


def unit_of(stage: str) -> UnitPolicy:
    for u in UNITS:
        if stage in u.stages:
            return u
    raise KeyError(stage)


def always_fp32_nodes(unit: UnitPolicy, graph: Path) -> list[str]:
    """The node names of the unit's always-fp32 groups in `graph`."""
    groups = groups_in(unit, onnx.load(str(graph), load_external_data=False))
    return [n for g in unit.always_fp32 for n in groups.get(g, [])]


def convert_companions(src: Path, dst: Path, precision: str, files: dict[str, Path]) -> dict[str, Path]:
    """Write each companion of `src` in `precision` into `dst` the way its
    base stage was written (a base kept in fp32 keeps its companions fp32)."""
    out: dict[str, Path] = {}
    if precision not in COMPANION_PRECISIONS:
        return out
    manifest = json.loads((src / "manifest.json").read_text())
    for name, base in companions(manifest).items():
        if base not in files:
            continue
        graph = src / manifest["stages"][name]["file"]
        block = always_fp32_nodes(unit_of(base), graph)
        path = dst / f"{name}.{precision}.onnx"
        if precision == "fp16":
            convert_fp16(graph, path, block)
        elif quantize_weight_only(graph, path, block) == 0:
            path.unlink()
            continue
        out[name] = path
    return out


def add_companion_variants(dst: Path, precision: str, files: dict[str, Path]) -> dict[str, Any]:
    """Record the companions' `precision` variants in dst/manifest.json."""
    manifest: dict[str, Any] = json.loads((dst / "manifest.json").read_text())
    for name, path in files.items():
        manifest["stages"][name].setdefault("variants", {})[precision] = {
            "file": path.name, "sha256": sha256_file(path), "precision": precision}
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
