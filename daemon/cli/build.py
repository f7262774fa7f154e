"""`cosyedge build ...`: wiring from the parsed arguments to the builders."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from cosyedge_models.errors import CosyEdgeError


def build_command(args: argparse.Namespace) -> int:
    cmd = args.build_cmd
    if cmd == "tiny":
        from cosyedge_build.checkpoint.tiny import build_tiny_checkpoint

        started = time.monotonic()
        out = build_tiny_checkpoint(Path(args.out), seed=args.seed, size=args.size)
        print(
            f"wrote a {args.size} CosyVoice 2 checkpoint (seed {args.seed}) to {out} "
            f"in {time.monotonic() - started:.1f} s"
        )
        return 0
    if cmd == "export":
        from cosyedge_build.export import export_bundle

        started = time.monotonic()
        windows = tuple(int(w) for w in args.static_flow_windows.split(",") if w.strip())
        batches = tuple(int(b) for b in args.fused_decode_batches.split(",") if b.strip())
        flow_batches = tuple(int(b) for b in args.batch_flow_sizes.split(",") if b.strip())
        first_hops = tuple(int(h) for h in args.static_vocoder_first_hops.split(",") if h.strip())
        out = export_bundle(Path(args.model_dir), Path(args.out), args.static_decode_len, windows,
                            args.static_flow_cache, args.static_vocoder, batches, args.fused_decode_len,
                            flow_batches, args.fused_decode_precision, first_hops, args.batch_flow_precision,
                            args.batch_flow_attention,
                            tuple(int(t) for t in args.fused_prefill_lengths.split(",") if t.strip()), args.jobs,
                            tuple(int(h) for h in args.static_vocoder_hops.split(",") if h.strip()))
        print(f"exported {args.model_dir} to the bundle {out} in {time.monotonic() - started:.1f} s")
        return 0
    if cmd == "engines":
        from cosyedge_daemon.cli.build_engines import engines_command

        return engines_command(args)
    if cmd == "quantize":
        from cosyedge_daemon.cli.build_quantize import quantize_command

        return quantize_command(args)
    if cmd == "validate":
        from cosyedge_build.validate import validate_command

        return validate_command(args)
    raise CosyEdgeError(
        f"unknown build command '{cmd}'; expected tiny, export, quantize, engines or validate"
    )
