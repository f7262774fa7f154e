"""How long the fused LLM graphs take to export, the two ways: every batch size and prompt
length built (and converted) alone, as `build export` did before, and the smallest of each
resized (edge_build/export/llm_fused.py, export_fused_decode). The setup of a GPU lease and a
board's `build export --fused-decode-batches` both wait for it.

    python -m cosyedge_build.tools.fused_export_time --model-dir CKPT --out F.json \
        [--batches 1,4,8,16] [--prefill-lengths 128,256,384] [--positions 1536] [--precision fp16]

Writes F.json (seconds each way, per graph for the one-by-one way, the machine) and checks
that both ways wrote the same bytes."""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cosyedge_build.export.llm import llm_dims
from cosyedge_build.export.llm_fused import (
    build_fused_decode,
    build_fused_prefill,
    build_kv_insert,
    convert_fused_fp16_in_place,
    export_fused_decode,
)
from cosyedge_build.reference.modules import load_reference, require
from cosyedge_models.bundle.loader import sha256_file


def _one_by_one(llm: Any, out: Path, batches: Sequence[int], lengths: Sequence[int], positions: int,
                precision: str) -> dict[str, float]:
    """Each graph built, saved and converted alone (the export before the resizing)."""
    onnx = require("onnx", "onnx", "timing the fused export")
    seconds = {}
    builds = [(build_fused_decode, b) for b in batches] + [(build_fused_prefill, t) for t in lengths]
    for build, size in builds:
        start = time.monotonic()
        model, stage = build(llm, size, positions)
        path = out / stage.file
        onnx.save_model(model, str(path))
        del model
        if precision == "fp16":
            convert_fused_fp16_in_place(path)
        seconds[stage.name] = round(time.monotonic() - start, 2)
    start = time.monotonic()
    model, stage = build_kv_insert(llm_dims(llm), positions)
    onnx.save_model(model, str(out / stage.file))
    if precision == "fp16":
        convert_fused_fp16_in_place(out / stage.file)
    seconds[stage.name] = round(time.monotonic() - start, 2)
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--prefill-lengths", default="128,256,384")
    parser.add_argument("--positions", type=int, default=1536)
    parser.add_argument("--precision", default="fp16", choices=["fp32", "fp16"])
    args = parser.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",") if x]
    lengths = [int(x) for x in args.prefill_lengths.split(",") if x]
    llm = load_reference(args.model_dir).llm
    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:
        alone, resized = Path(tmp) / "alone", Path(tmp) / "resized"
        alone.mkdir()
        resized.mkdir()
        start = time.monotonic()
        stages = export_fused_decode(llm, resized, batches, args.positions, args.precision, lengths)
        resized_s = time.monotonic() - start
        start = time.monotonic()
        per_graph = _one_by_one(llm, alone, batches, lengths, args.positions, args.precision)
        alone_s = time.monotonic() - start
        same = {s.file: sha256_file(alone / s.file) == sha256_file(resized / s.file) for s in stages}
        sizes = {s.file: (resized / s.file).stat().st_size for s in stages}
    result = {
        "what": "the fused LLM graphs' export (llm_fused.export_fused_decode) against each graph built and "
                "converted alone (the export before the resizing)",
        "batches": batches, "prefill_lengths": lengths, "positions": args.positions, "precision": args.precision,
        "model_dir": str(args.model_dir), "graph_bytes": sizes,
        "seconds": {"resized": round(resized_s, 2), "one_by_one": round(alone_s, 2)},
        "one_by_one_per_graph_s": per_graph, "same_bytes": same,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.machine()},
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["seconds"]), "same bytes:", all(same.values()))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
