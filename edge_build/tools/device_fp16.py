"""An fp16 bundle for a GPU run, without the calibration and accuracy report
of `cosyedge build quantize --precision fp16` (at full size those run the
fp32 and fp16 pipelines on the CPU for many minutes, too long for a device
lease): the same conversion (edge_build/quantize/fp16.py: only Sin/Cos/Exp/
Softplus/Pow, reductions and index arithmetic kept fp32 with their elementwise
tails and arguments; LayerNorm and Softmax in fp16; the flow's time embedding,
hift_source and the flow encoder kept fp32). The companions (the
fixed-size decode step, the fixed-shape estimator graphs) are converted as
`build quantize` converts them (edge_build/quantize/companions.py), and the
three LLM graphs share one fp16 weight file. The fused batched LLM step
(`llm_decode_fused_b<B>`, `llm_fused_kv_insert`), where the source has it in
fp32, gets fp16 variants (edge_build/export/llm_fused.py's conversion: its KV
cache in fp16, what ort-cuda's GroupQueryAttention runs); fp16 ones are kept as
they are. The overflow check
(edge_build/quantize/finite.py) runs the fp16 stage graphs on calibration
feeds captured from the fp32 bundle (`--check-texts`, 0 skips it) with the
CUDA provider where there is one, writes the result to DST/fp16_check.json
and exits 3 when a stage gave NaN/Inf (the bundle is kept, for inspection).
The fixed-shape companions are checked by tests/edge_build/tools/test_fp16_gpu.py
(they are not reached by the capture). `cosyedge bench --compare` reports this
bundle's mel SNR and token agreement against the fp32 one.

    python -m cosyedge_build.tools.device_fp16 --bundle SRC --out DST [--check-texts 4]"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cosyedge_build.export.flow_batch import is_kv_io, write_fp16
from cosyedge_build.export.llm_fused import convert_fused_fp16, fp16_fields, is_fused_stage
from cosyedge_build.export.shared_weights import share_llm_files
from cosyedge_build.quantize.capture import capture_feeds
from cosyedge_build.quantize.companions import (
    add_companion_variants,
    always_fp32_nodes,
    convert_companions,
    fp16_io,
)
from cosyedge_build.quantize.finite import FINITE_CHECK_FILE, failures, finite_check
from cosyedge_build.quantize.fp16 import convert_fp16
from cosyedge_build.quantize.policy import UNITS
from cosyedge_build.quantize.texts import calibration_texts
from cosyedge_build.quantize.writer import add_variants, link_bundle
from cosyedge_models.bundle.loader import BATCH_FLOW_NAME, sha256_file

log = logging.getLogger(__name__)


def fp16_bundle(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=False)
    link_bundle(src, dst)
    manifest = json.loads((src / "manifest.json").read_text())
    files: dict[str, Path] = {}
    for u in UNITS:
        for stage in u.stages:
            files[stage] = dst / f"{stage}.fp16.onnx"
            convert_fp16(src / f"{stage}.onnx", files[stage], always_fp32_nodes(u, src / f"{stage}.onnx"),
                         fp16_io(stage, manifest))
            log.info("converted %s", stage)
    extra = convert_companions(src, dst, "fp16", files)  # the fixed-shape graphs, as `build quantize` does
    share_llm_files(dst, {**files, **extra}, "llm_weights.fp16.bin")
    add_variants(dst, "fp16", files, {}, "none (edge_build/tools/device_fp16.py)")
    add_companion_variants(dst, "fp16", extra)
    add_fused_variants(dst, fused_fp16_variants(src, dst, manifest))
    return dst


def fused_fp16_variants(src: Path, dst: Path, manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The fp16 variant entries of the source's fp32 fused decode stages, their
    graphs written to dst/<stage>.fp16.onnx (fp16 stages need none)."""
    variants: dict[str, dict[str, Any]] = {}
    for name, entry in manifest.get("stages", {}).items():
        if not is_fused_stage(name) or entry.get("kv_cache", {}).get("dtype", "float32") != "float32":
            continue
        path = dst / f"{name}.fp16.onnx"
        convert_fused_fp16(src / entry["file"], path)
        variants[name] = {"file": path.name, "sha256": sha256_file(path), **fp16_fields(entry)}
        log.info("converted %s", name)
    return variants


def lanes_fp16_bundle(src: Path, dst: Path) -> Path:
    """`src` (linked) with its fp32 batched estimator graphs replaced by their fp16 conversion
    (what `build export --batch-flow-precision fp16` writes), so that one device lease compares
    the fp32 and the fp16 lanes without a second export of the checkpoint."""
    dst.mkdir(parents=True, exist_ok=False)
    link_bundle(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    for name, entry in manifest["stages"].items():
        if not BATCH_FLOW_NAME.match(name) or entry.get("precision") == "fp16":
            continue
        path = dst / entry["file"]
        old = entry.pop("external_data", None)
        # a new file in place of the link: the source bundle keeps its graph
        data = write_fp16(src / entry["file"], path, dst / old["file"] if old else None)
        if data is not None:
            entry["external_data"] = {"file": data, "sha256": sha256_file(dst / data)}
        for spec in (*entry["inputs"], *entry["outputs"]):
            if is_kv_io(spec["name"]):
                spec["dtype"] = "float16"
        entry.update(sha256=sha256_file(path), precision="fp16")
        log.info("converted %s", name)
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return dst


def add_fused_variants(dst: Path, variants: dict[str, dict[str, Any]]) -> None:
    manifest = json.loads((dst / "manifest.json").read_text())
    for name, variant in variants.items():
        manifest["stages"][name].setdefault("variants", {})["fp16"] = variant
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def check_bundle(src: Path, dst: Path, texts: int, backend: str | None = None) -> dict[str, Any]:
    """The overflow check of `dst` (made from `src` by fp16_bundle) on `texts` calibration
    texts, with `backend` (None: ort-cuda where onnxruntime has CUDA, else ort); written
    to dst/FINITE_CHECK_FILE."""
    import onnxruntime as ort

    if backend is None:
        backend = "ort-cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else "ort"
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if backend == "ort-cuda" else ["CPUExecutionProvider"]
    feeds = capture_feeds(src, calibration_texts(texts), cap_per_stage=12, backend=backend).feeds
    graphs = {stage: dst / f"{stage}.fp16.onnx" for u in UNITS for stage in u.stages}
    check = {**finite_check(graphs, feeds, providers), "texts": texts, "capture_backend": backend}
    (dst / FINITE_CHECK_FILE).write_text(json.dumps(check, indent=2) + "\n")
    return check


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_build.tools.device_fp16", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--check-texts", type=int, default=4, help="calibration texts for the NaN/Inf check (0: skip)")
    p.add_argument("--check-backend", choices=("ort", "ort-cuda"), default=None,
                   help="where the check captures and runs (default: ort-cuda where onnxruntime has CUDA)")
    p.add_argument("--lanes-only", action="store_true",
                   help="only the batched estimator graphs in fp16 (the fp16 lanes), the rest linked as it is")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.lanes_only:
        print(lanes_fp16_bundle(args.bundle, args.out))
        return 0
    print(fp16_bundle(args.bundle, args.out))
    if args.check_texts > 0:
        check = check_bundle(args.bundle, args.out, args.check_texts, args.check_backend)
        for line in failures(check):
            log.error("%s", line)
        print(f"fp16 check ({', '.join(check['providers'])}): {'finite' if check['ok'] else 'FAILED'}, "
              f"{args.out / FINITE_CHECK_FILE}")
        if not check["ok"]:
            return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
