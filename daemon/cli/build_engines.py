"""`cosyedge build engines --bundle B`: the CLI wiring for cosyedge_build.tensorrt.engines.

daemon/cli/build.py calls `add_engines_arguments(parser)` on its `engines`
subparser and `engines_command(args)` when it is chosen."""

from __future__ import annotations

import argparse
import json

from cosyedge_models.bundle.loader import STAGES
from cosyedge_models.bundle.memory_budget import BOARDS


def add_engines_arguments(p: argparse.ArgumentParser) -> None:
    """The options beyond --bundle (safe to call on a parser that has --bundle)."""
    if not any("--bundle" in a.option_strings for a in p._actions):
        p.add_argument("--bundle", required=True, help="bundle directory (engines are written into it)")
    p.add_argument("--precision", choices=["fp32", "fp16", "int8"],
                   help="which stage variant to build from (default: the bundle's own)")
    p.add_argument("--board", choices=sorted(BOARDS),
                   help="Jetson module to size the workspace and the memory check for (default: guessed on Jetson)")
    p.add_argument("--workspace-mib", type=int, help="TensorRT builder workspace limit (default: per board; "
                                                     "512 MiB on an Orin Nano 8 GB)")
    p.add_argument("--max-batch", type=int, help="cap the batch dimension of every profile (B; N = 2B)")
    p.add_argument("--stages", help=f"comma-separated subset of: {','.join(STAGES)} and the bundle's fixed-shape "
                                    "stages (default: all of them)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--json", dest="json_out", help="also write the engines metadata to this file")


def engines_command(args: argparse.Namespace) -> int:
    from cosyedge_build.tensorrt.engines import EngineBuildSettings, build_engines

    raw_stages: str | None = getattr(args, "stages", None)
    stages = tuple(s.strip() for s in raw_stages.split(",") if s.strip()) if raw_stages else None
    settings = EngineBuildSettings(
        precision=getattr(args, "precision", None),
        board=getattr(args, "board", None),
        workspace_mib=getattr(args, "workspace_mib", None),
        max_batch=getattr(args, "max_batch", None),
        stages=stages,
        device_id=int(getattr(args, "device", 0) or 0),
    )
    engines = build_engines(args.bundle, settings)
    out = getattr(args, "json_out", None)
    if out:
        with open(out, "w") as f:
            json.dump(engines, f, indent=2)
    print(f"engines written to {args.bundle} (TensorRT {engines['tensorrt']}, {engines['gpu']})")
    return 0
