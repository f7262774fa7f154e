"""`cosyedge bench`: real-time factor, time to first audio, time per stage,
peak memory, throughput under concurrency, streaming vs offline cost, and
(with --reference) the official PyTorch pipeline on the same checkpoint in
the same run. Writes the keys the project tracks with --json."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from models.api import SynthesisRequest
from models.engine import CosyVoiceEngine, EngineSettings, load_engine

# 20 text tokens with the real Qwen2 tokenizer: a random-weight model then
# speaks the maximum 20 x 20 = 400 speech tokens (16 s), as upstream measured.
DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog while the robot reads the news aloud."
LONG_TEXT = ("The kiosk greets every visitor, explains the opening hours, lists the exhibits on each floor, "
             "and answers questions about tickets, parking and the cafe")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"


def run_once(engine: CosyVoiceEngine, text: str, stream: bool, seed: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = None
    samples = 0
    last = None
    for chunk in engine.synthesize(SynthesisRequest(text=text, stream=stream, seed=seed)):
        if first is None and chunk.pcm.size:
            first = (time.perf_counter() - t0) * 1e3
        samples += chunk.pcm.size
        last = chunk
    total = time.perf_counter() - t0
    audio_s = samples / engine.sample_rate
    times = last.times.as_dict() if last is not None else {}
    return {"total_s": total, "audio_s": audio_s, "rtf": total / audio_s if audio_s else float("nan"),
            "first_audio_ms": first, "stages_ms": times}


def run_concurrent(engine: CosyVoiceEngine, text: str, n: int) -> dict[str, float]:
    results: list[dict[str, Any]] = [{} for _ in range(n)]

    def worker(i: int) -> None:
        results[i] = run_once(engine, text, stream=True, seed=1000 + i)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    firsts = [r["first_audio_ms"] for r in results if r.get("first_audio_ms") is not None]
    tokens = sum(int(r["stages_ms"].get("llm_tokens", 0)) for r in results)
    audio = sum(r["audio_s"] for r in results)
    return {
        "requests_per_s": round(n / wall, 4),
        "tokens_per_s": round(tokens / wall, 2),
        "first_audio_ms_p50": round(float(np.percentile(firsts, 50)), 1) if firsts else float("nan"),
        "first_audio_ms_p95": round(float(np.percentile(firsts, 95)), 1) if firsts else float("nan"),
        "rtf": round(wall / audio, 4) if audio else float("nan"),
    }


def bench_command(args: argparse.Namespace) -> int:
    text = args.text or DEFAULT_TEXT
    settings = EngineSettings(backend=args.backend,
                              flow_final_chunk=getattr(args, "flow_final_chunk", "cached"))
    engine = load_engine(args.bundle, settings=settings)
    try:
        run_once(engine, text, stream=True, seed=0)  # warm-up: session arenas, page-in of weights
        offline = [run_once(engine, text, stream=False, seed=r) for r in range(args.repeats)]
        streaming = [run_once(engine, text, stream=True, seed=r) for r in range(args.repeats)]
        report: dict[str, Any] = {
            "machine": machine(),
            "bundle": str(Path(args.bundle).resolve()),
            "precision": engine.bundle.precision,
            "backend": engine.backend.describe(),
            "text": text,
            "audio_s": round(statistics.median(r["audio_s"] for r in offline), 3),
            "rtf": round(statistics.median(r["rtf"] for r in offline), 4),
            "streaming_rtf": round(statistics.median(r["rtf"] for r in streaming), 4),
            "first_audio_ms": round(statistics.median(r["first_audio_ms"] for r in streaming), 1),
            "stages_ms": {k: round(statistics.median(float(r["stages_ms"][k] or 0) for r in offline), 1)
                          for k in ("frontend_ms", "llm_ms", "flow_ms", "vocoder_ms")},
        }
        long_off = run_once(engine, LONG_TEXT, stream=False, seed=7)
        long_str = run_once(engine, LONG_TEXT, stream=True, seed=7)
        flow_off, flow_str = long_off["stages_ms"], long_str["stages_ms"]
        report["streaming_cost_vs_offline"] = {
            "audio_s": round(long_off["audio_s"], 2),
            "ratio": round(long_str["total_s"] / long_off["total_s"], 3),
            # the flow alone (where streaming's extra work was): wall time and estimator frames
            "flow_ms_ratio": round(float(flow_str["flow_ms"] or 0) / max(float(flow_off["flow_ms"] or 0), 1e-9), 3),
            "flow_frames_ratio": round(float(flow_str.get("flow_frames") or 0)
                                       / max(float(flow_off.get("flow_frames") or 0), 1.0), 3),
            "flow_final_chunk": settings.flow_final_chunk,
        }
        report["concurrency"] = {
            str(n): run_concurrent(engine, text, n) for n in (int(x) for x in args.concurrency.split(",") if x)
        }
        report["peak_rss_mb"] = round(peak_rss_mb(), 1)  # before the reference loads torch
        if args.reference:
            from edge_build.reference_pipeline import run_reference

            ref = run_reference(engine.bundle, engine.tokenizer, text, repeats=args.repeats)
            report["reference"] = ref
            report["speedup_vs_reference"] = round(ref["rtf"] / report["rtf"], 3)
            report["first_audio_vs_reference"] = round(report["first_audio_ms"] / ref["first_audio_ms"], 3)
    finally:
        engine.close()
    text_out = json.dumps(report, indent=2)
    print(text_out)
    if args.json:
        Path(args.json).write_text(text_out + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
