"""Memory an engine holds, measured from the kernel's accounting of this
process (/proc/self/smaps_rollup): Pss counts a page mapped several times
(one file mapped by several sessions) once, so it shows whether weights are
shared; Rss would count each mapping; anonymous memory is what sessions
allocated (prepacked weight copies, arenas).

`python -m cosyedge_models.tools.engine_memory BUNDLE [--precision P] [--backend B]` loads
the engine as the daemon does (every stage session), synthesizes one short
text (so every weight has been touched), and prints the growth as JSON: one
bundle per process, so nothing of an earlier bundle is counted."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

FIELDS = ("Rss", "Pss", "Anonymous", "Pss_File", "Pss_Anon")


def process_memory(path: Path = Path("/proc/self/smaps_rollup")) -> dict[str, int]:
    """Bytes per smaps_rollup field (empty where the kernel has no such file)."""
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in FIELDS and rest.strip().endswith("kB"):
            out[key.lower() + "_bytes"] = int(rest.split()[0]) * 1024
    return out


def memory_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_models.tools.engine_memory")
    p.add_argument("bundle")
    p.add_argument("--precision", default=None)
    p.add_argument("--backend", default="ort")
    p.add_argument("--graph-decode", choices=("auto", "on", "off"), default="auto",
                   help="load the fixed-size decode step too (on), as ort-cuda does by default")
    p.add_argument("--graph-flow", choices=("auto", "on", "off"), default="auto",
                   help="the fixed-shape flow graphs and their slots (auto: on for ort-cuda, as the daemon loads)")
    p.add_argument("--graph-vocoder", choices=("auto", "on", "off"), default="auto",
                   help="the fixed-length vocoder graphs (auto: on for ort-cuda, as the daemon loads)")
    p.add_argument("--cpu-arena", choices=("on", "off"), default="off",
                   help="onnxruntime's CPU memory arena (SynthesisSettings.cpu_memory_arena; default off)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from cosyedge_models.backends.gpu_probe import device_memory_used
    from cosyedge_models.synthesis.api import SynthesisRequest
    from cosyedge_models.synthesis.settings import SynthesisSettings
    from cosyedge_models.synthesis.synthesizer import load_synthesizer
    from cosyedge_models.tools.host import machine

    auto = {"auto": None, "on": True, "off": False}
    def device() -> int | None:
        return device_memory_used() if args.backend != "ort" else None

    before, device_before = process_memory(), device()
    t0 = time.perf_counter()
    engine = load_synthesizer(args.bundle, settings=SynthesisSettings(
        backend=args.backend, precision=args.precision, graph_decode=auto[args.graph_decode],
        graph_flow=auto[args.graph_flow], graph_vocoder=auto[args.graph_vocoder],
        cpu_memory_arena=args.cpu_arena == "on"))
    load_ms = round((time.perf_counter() - t0) * 1e3, 1)  # sessions, warm-ups and CUDA-graph captures
    try:
        loaded, device_loaded = process_memory(), device()
        for _ in engine.synthesize(SynthesisRequest(text="Hello there, this is a test.", seed=0)):
            pass
        warm, device_warm = process_memory(), device()
        report = {"bench": "engine_memory", "machine": machine(args.backend),
                  "bundle": str(Path(args.bundle).resolve()), "precision": engine.bundle.precision,
                  "backend": args.backend, "graph_decode": args.graph_decode, "graph_flow": args.graph_flow,
                  "graph_vocoder": args.graph_vocoder,
                  "cpu_arena": args.cpu_arena, "load_ms": load_ms,
                  "sessions": sorted(s.name for s in engine._sessions),
                  "session_memory_bytes": engine.session_memory_bytes(),
                  "after_load": memory_delta(before, loaded), "after_synthesis": memory_delta(before, warm)}
        if device_before is not None and device_loaded is not None and device_warm is not None:
            # the GPU's own accounting: what loading (sessions, shared weights, slots) and one synthesis took
            report["device_after_load_bytes"] = device_loaded - device_before
            report["device_after_synthesis_bytes"] = device_warm - device_before
    finally:
        engine.close()
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
