"""An fp16 bundle for a GPU run, without the calibration and accuracy report
of `cosyedge build quantize --precision fp16` (at full size those run the
fp32 and fp16 pipelines on the CPU for many minutes, too long for a device
lease): the same conversion (edge_build/quantize/fp16.py: normalization,
softmax, transcendental ops and reductions kept fp32, the flow's time
embedding kept fp32, hift_source and the flow encoder kept fp32), plus the
fixed-shape estimator graphs converted the same way. The estimator keeps
its K/V cache in fp32 here (fp16 inside the graph), so the fixed-shape
graphs and the dynamic one share one cache layout. NaN/Inf on the tiny
bundle's calibration set is tested in tests/edge_build (CPU and `-m gpu`);
`cosyedge bench --compare` reports this bundle's mel SNR and token
agreement against the fp32 one.

    python -m cosyedge_build.tools.device_fp16 --bundle SRC --out DST"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from cosyedge_build.quantize.fp16 import convert_fp16
from cosyedge_build.quantize.pipeline import _always_fp32_nodes
from cosyedge_build.quantize.policy import UNITS, unit
from cosyedge_build.quantize.writer import add_variants, link_bundle
from cosyedge_models.bundle.loader import STATIC_FLOW_PREFIX, sha256_file

log = logging.getLogger(__name__)


def fp16_bundle(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=False)
    link_bundle(src, dst)
    files: dict[str, Path] = {}
    for u in UNITS:
        for stage in u.stages:
            files[stage] = dst / f"{stage}.fp16.onnx"
            convert_fp16(src / f"{stage}.onnx", files[stage], _always_fp32_nodes(u, src / f"{stage}.onnx"))
            log.info("converted %s", stage)
    manifest = add_variants(dst, "fp16", files, {}, "none (edge_build/tools/device_fp16.py)")
    manifest["stages"]["flow_estimator"]["variants"]["fp16"].pop("fp16_io", None)  # fp32 cache I/O here
    flow = unit("flow")
    for name, entry in manifest["stages"].items():
        if name.startswith(STATIC_FLOW_PREFIX):
            path = dst / f"{name}.fp16.onnx"
            convert_fp16(src / entry["file"], path, _always_fp32_nodes(flow, src / entry["file"]))
            entry.setdefault("variants", {})["fp16"] = {"file": path.name, "sha256": sha256_file(path),
                                                         "precision": "fp16"}
            log.info("converted %s", name)
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return dst


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_build.tools.device_fp16", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(fp16_bundle(args.bundle, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
