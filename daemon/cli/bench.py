"""`cosyedge bench`: the measurements are cosyedge_models.tools.bench; with
--reference the official PyTorch pipeline comes from the build side, imported
here only then (it needs the build extra)."""

from __future__ import annotations

import argparse
import sys

from cosyedge_models.errors import MissingExtraError


def bench_command(args: argparse.Namespace) -> int:
    from cosyedge_models.tools.bench import ReferenceRunner
    from cosyedge_models.tools.bench import bench_command as run_bench

    if args.python_switch_interval_ms is not None:  # process-wide: set here, at the entry point
        sys.setswitchinterval(args.python_switch_interval_ms / 1e3)
    reference: ReferenceRunner | None = None
    if args.reference:
        try:
            from cosyedge_build.reference.pipeline import run_reference
        except ImportError as exc:
            raise MissingExtraError(str(exc.name or "torch"), "build", "bench --reference") from exc
        reference = run_reference
    return run_bench(args, reference)
