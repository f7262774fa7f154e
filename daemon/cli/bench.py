"""`cosyedge bench`: the measurements are cosyedge_models.tools.bench; with
--reference the official PyTorch pipeline comes from the build side, imported
here only then (it needs the build extra)."""

from __future__ import annotations

import argparse

from cosyedge_models.errors import MissingExtraError


def bench_command(args: argparse.Namespace) -> int:
    from cosyedge_models.tools.bench import ReferenceRunner
    from cosyedge_models.tools.bench import bench_command as run_bench

    reference: ReferenceRunner | None = None
    if args.reference:
        try:
            from cosyedge_build.reference.pipeline import run_reference
        except ImportError as exc:
            raise MissingExtraError(str(exc.name or "torch"), "build", "bench --reference") from exc
        reference = run_reference
    return run_bench(args, reference)
