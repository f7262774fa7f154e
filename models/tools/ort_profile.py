"""Where ONNX Runtime spends a stage's time: with COSYEDGE_ORT_PROFILE=DIR
every session the ort backends load writes onnxruntime's own profile (one
JSON trace per session, written when the session closes) into DIR; this
module sums those traces per stage: runs, milliseconds per run, the split
by execution provider, the slowest operator types, the nodes a GPU session
left on the CPU and the host/device copies per run (what makes a CUDA
session launch- or copy-bound).

    COSYEDGE_ORT_PROFILE=/tmp/prof cosyedge bench --bundle B --backend ort-cuda --repeats 1
    python -m cosyedge_models.tools.ort_profile /tmp/prof"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cosyedge_models.backends.profiling import PROFILE_ENV

_COPY_OPS = ("MemcpyToHost", "MemcpyFromHost")
_STAMP = re.compile(r"_\d{4}-\d{2}-\d{2}_[\d_-]+$")  # e.g. _2026-11-29_19-57-30_938


@dataclass
class OpTime:
    op: str
    provider: str
    ms: float
    calls: int


@dataclass
class StageProfile:
    stage: str
    runs: int = 0
    run_ms: float = 0.0  # wall time of the runs (model_run events)
    kernel_ms: float = 0.0  # sum of the node kernels
    provider_ms: dict[str, float] = field(default_factory=dict)
    top_ops: list[OpTime] = field(default_factory=list)
    cpu_nodes: list[str] = field(default_factory=list)  # in a session whose first provider is a GPU's
    copies_per_run: float = 0.0
    kernels_per_run: float = 0.0

    @property
    def ms_per_run(self) -> float:
        return self.run_ms / self.runs if self.runs else 0.0


def _stage_of(path: Path) -> str:
    # the backend names the traces <stage>_<onnxruntime's time stamp>.json
    return _STAMP.sub("", path.stem)


def summarize_trace(stage: str, events: Sequence[dict[str, Any]], top: int = 8) -> StageProfile:
    prof = StageProfile(stage)
    ops: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    providers: dict[str, float] = defaultdict(float)
    cpu_nodes: set[str] = set()
    kernels = copies = 0
    for ev in events:
        if ev.get("cat") == "Session" and ev.get("name") == "model_run":
            prof.runs += 1
            prof.run_ms += float(ev.get("dur", 0)) / 1e3
        elif ev.get("cat") == "Node" and str(ev.get("name", "")).endswith("_kernel_time"):
            args = ev.get("args", {})
            op, provider = str(args.get("op_name", "?")), str(args.get("provider", "?"))
            ms = float(ev.get("dur", 0)) / 1e3
            entry = ops[(op, provider)]
            entry[0] += ms
            entry[1] += 1
            providers[provider] += ms
            kernels += 1
            copies += op in _COPY_OPS
            if provider == "CPUExecutionProvider":
                cpu_nodes.add(str(ev["name"]).removesuffix("_kernel_time"))
    prof.kernel_ms = sum(providers.values())
    prof.provider_ms = {p: round(ms, 3) for p, ms in sorted(providers.items(), key=lambda kv: -kv[1])}
    ranked = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
    prof.top_ops = [OpTime(op, prov, round(v[0], 3), int(v[1])) for (op, prov), v in ranked]
    on_gpu = any(p != "CPUExecutionProvider" for p in providers)
    prof.cpu_nodes = sorted(cpu_nodes) if on_gpu else []
    if prof.runs:
        prof.copies_per_run = copies / prof.runs
        prof.kernels_per_run = kernels / prof.runs
    return prof


def summarize_dir(directory: Path, top: int = 8) -> list[StageProfile]:
    """One StageProfile per stage (traces of several sessions of one stage are summed)."""
    by_stage: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(directory.glob("*.json")):
        try:
            events = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a trace still being written, or not one of ours
        if isinstance(events, list):
            by_stage[_stage_of(path)].extend(e for e in events if isinstance(e, dict))
    return [summarize_trace(stage, events, top) for stage, events in sorted(by_stage.items())]


def render(profiles: Sequence[StageProfile]) -> str:
    lines = []
    for p in profiles:
        lines.append(f"{p.stage}: {p.runs} runs, {p.ms_per_run:.2f} ms/run, {p.kernels_per_run:.0f} kernels "
                     f"and {p.copies_per_run:.1f} host/device copies per run; by provider (ms) {p.provider_ms}")
        for op in p.top_ops:
            lines.append(f"    {op.op:<24} {op.provider:<24} {op.ms:10.2f} ms  {op.calls:7d} calls")
        if p.cpu_nodes:
            shown = ", ".join(p.cpu_nodes[:10]) + (" ..." if len(p.cpu_nodes) > 10 else "")
            lines.append(f"    on the CPU in a GPU session: {len(p.cpu_nodes)} nodes ({shown})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyedge_models.tools.ort_profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--top", type=int, default=8, help="operator types shown per stage")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        print(f"{args.directory}: no such directory", file=sys.stderr)
        return 2
    profiles = summarize_dir(args.directory, args.top)
    if not profiles:
        print(f"{args.directory}: no onnxruntime profiles (run with {PROFILE_ENV}={args.directory})", file=sys.stderr)
        return 1
    print(render(profiles))
    if args.json:
        rows = [asdict(p) | {"ms_per_run": p.ms_per_run} for p in profiles]
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
