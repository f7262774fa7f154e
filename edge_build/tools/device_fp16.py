"""An fp16 bundle for a GPU run, without the calibration and accuracy report
of `cosyedge build quantize --precision fp16` (at full size those run the
fp32 and fp16 pipelines on the CPU for many minutes, too long for a device
lease): the same conversion (edge_build/quantize/fp16.py: only Sin/Cos/Exp/
Softplus/Pow, reductions and index arithmetic kept fp32 with their elementwise
tails and arguments; LayerNorm and Softmax in fp16; the flow's time embedding,
hift_source and the flow encoder kept fp32). The companions (the
fixed-size decode step, the fixed-shape estimator graphs) are converted as
`build quantize` converts them (edge_build/quantize/companions.py), and the
three LLM graphs share one fp16 weight file. NaN/Inf on the tiny
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

from cosyedge_build.export.shared_weights import share_llm_files
from cosyedge_build.quantize.companions import (
    add_companion_variants,
    always_fp32_nodes,
    convert_companions,
    fp16_io,
)
from cosyedge_build.quantize.fp16 import convert_fp16
from cosyedge_build.quantize.policy import UNITS
from cosyedge_build.quantize.writer import add_variants, link_bundle

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
