"""A bundle for a GPU run whose batched estimator windows are exported again from the checkpoint
in another precision or attention (what `build export --batch-flow-precision P
--batch-flow-attention A` writes), everything else linked from the source bundle (its voices
too): one device lease then compares the lanes' variants without exporting the whole checkpoint
again (minutes at full size). The batch sizes, windows and cache are the source's.

    python -m cosyedge_build.tools.device_lanes --bundle SRC --model-dir CKPT --out DST \\
        [--precision fp16] [--attention fused]"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from cosyedge_build.export.bundle import stage_entry
from cosyedge_build.export.flow_batch import ATTENTIONS, PRECISIONS, check_options, export_batch_estimators
from cosyedge_build.quantize.writer import link_bundle
from cosyedge_build.reference.modules import load_reference
from cosyedge_models.bundle.loader import BATCH_FLOW_NAME

log = logging.getLogger(__name__)


def lanes_bundle(src: Path, model_dir: Path, dst: Path, precision: str, attention: str) -> Path:
    check_options(precision, attention)
    manifest = json.loads((src / "manifest.json").read_text())
    batched = {name: entry for name, entry in manifest["stages"].items() if BATCH_FLOW_NAME.match(name)}
    if not batched:
        raise ValueError(f"{src} has no batched estimator windows (build export --batch-flow-sizes)")
    first = next(iter(batched.values()))
    dst.mkdir(parents=True, exist_ok=False)
    link_bundle(src, dst)
    for entry in batched.values():  # the source's graphs (links or copies) make way for the new ones
        (dst / entry["file"]).unlink()
        if "external_data" in entry:
            (dst / entry["external_data"]["file"]).unlink()
    flow = load_reference(model_dir).flow
    stages = export_batch_estimators(flow, dst, sorted({int(e["batch"]) for e in batched.values()}),
                                     sorted({int(e["window"]) for e in batched.values()}),
                                     int(first["cache_frames"]), int(first["chunk_frames"]), precision, attention)
    for stage in stages:
        manifest["stages"][stage.name] = stage_entry(dst, stage)
        log.info("exported %s (%s, %s attention)", stage.name, precision, attention)
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return dst


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_build.tools.device_lanes",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True, help="the source bundle (with --batch-flow-sizes)")
    p.add_argument("--model-dir", type=Path, required=True, help="the checkpoint the source bundle was exported from")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--precision", choices=PRECISIONS, default="fp16")
    p.add_argument("--attention", choices=ATTENTIONS, default="fused")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(lanes_bundle(args.bundle, args.model_dir, args.out, args.precision, args.attention))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
