"""The output bundle: the fp32 bundle's files linked (or copied), the
low-precision graphs added as stage variants, a new manifest."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from cosyedge_build.quantize.companions import fp16_io
from cosyedge_build.quantize.policy import FP32_STAGES
from cosyedge_models.bundle.loader import STAGES, sha256_file


def link_bundle(src: Path, dst: Path) -> None:
    """Hard-link every file of `src` into `dst` (copy across file systems),
    except manifest.json, which is copied (it is rewritten, and a link would
    share the inode: writing it would change the source bundle), and the
    graphs' external weight files (`*.bin`, `*.data`), which onnx reads only
    from files with one link."""
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        # manifest.json is rewritten; onnx refuses external weight data with
        # several hard links (a hardlink-attack guard), so those are copied too
        if rel == Path("manifest.json") or path.suffix in (".bin", ".data"):
            shutil.copyfile(path, target)
            continue
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)


def add_variants(dst: Path, precision: str, files: dict[str, Path], fp32_nodes: dict[str, list[str]],
                 report_file: str) -> dict[str, Any]:
    """Rewrite dst/manifest.json: each stage gets a `precision` variant (its
    low-precision graph, or its fp32 graph for the stages kept in fp32, so
    that an explicit `precision=` loads every stage) and the bundle's own
    precision becomes `precision`."""
    manifest = json.loads((dst / "manifest.json").read_text())
    for name in STAGES:
        entry = manifest["stages"][name]
        variants = entry.setdefault("variants", {})
        if name in files:
            path = files[name]
            variant: dict[str, Any] = {"file": path.name, "sha256": sha256_file(path), "precision": precision}
            if precision == "int8":
                variant["fp32_nodes"] = fp32_nodes.get(name, [])
            if precision == "fp16" and (kept := fp16_io(name, manifest)):
                variant["fp16_io"] = list(kept)
        else:
            why = "kept in fp32 (F0 predictor / source)" if name in FP32_STAGES else "kept in fp32"
            variant = {"file": entry["file"], "sha256": entry.get("sha256"), "precision": "fp32", "note": why}
        variants[precision] = variant
    manifest["precision"] = precision
    manifest.setdefault("quantization", {})[precision] = {"report": report_file}
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
