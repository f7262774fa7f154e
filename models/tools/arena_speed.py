"""Speed of one short text with onnxruntime's CPU memory arena on or off
(SynthesisSettings.cpu_memory_arena), one setting per process so that neither
inherits the other's allocations (docs/memory.md):

    python -m cosyedge_models.tools.arena_speed BUNDLE on|off [--runs 3]

Loads the bundle, runs one streaming warm-up, then offline and streaming
`--runs` times each (seed 0) and prints one JSON line: seconds per run, first
audio, and the process's Pss at the end."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

TEXT = "Hello there, this is a test."


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_models.tools.arena_speed")
    p.add_argument("bundle")
    p.add_argument("arena", choices=("on", "off"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--backend", default="ort")
    args = p.parse_args(argv)
    from cosyedge_models.synthesis.settings import SynthesisSettings
    from cosyedge_models.synthesis.synthesizer import load_synthesizer
    from cosyedge_models.tools.bench_runs import run_once
    from cosyedge_models.tools.engine_memory import process_memory

    engine = load_synthesizer(args.bundle, settings=SynthesisSettings(backend=args.backend,
                                                                      cpu_memory_arena=args.arena == "on"))
    try:
        run_once(engine, TEXT, stream=True, seed=0)
        out: dict[str, Any] = {"bundle": args.bundle, "cpu_memory_arena": args.arena, "text": TEXT,
                               "offline": [], "stream": []}
        for _ in range(args.runs):
            for stream in (False, True):
                r = run_once(engine, TEXT, stream=stream, seed=0)
                out["stream" if stream else "offline"].append(
                    {"total_s": round(r["total_s"], 3), "first_audio_ms": round(r["first_audio_ms"] or 0),
                     "audio_s": r["audio_s"]})
        out["pss_mb_after"] = round(process_memory()["pss_bytes"] / 2**20)
    finally:
        engine.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
