"""What one batched estimator replay costs, the lanes alone (no engine, no scheduling): for each
bundle given, its batched graphs of one window loaded on onnxruntime (captured on ort-cuda), every
lane holding `--cached` committed frames, then `BatchFlowGraphs.run` for 1, 8, 16 ... streams at
once, timed call by call (host copies, the replay, the conv history's copy, dphi back). On a GPU
with torch present it also counts the kernels of a replay and their summed GPU time (torch's
profiler sees onnxruntime's kernels: CUPTI traces the process), which tells launch-bound from
compute-bound, and writes the node counts by operator of the graph onnxruntime's CUDA provider
optimizes (what the fused attention removes). Compares the lanes' variants (plain / fused
attention, fp32 / fp16: edge_build/tools/device_lanes.py) on one machine. Where a bundle has the
fused batched LLM step (build export --fused-decode-batches), one step of each batch size is timed
and counted the same way (`llm_step`): the kernels of the LLM step that the board projection's
per-kernel model needs (docs/jetson-projection.md).

    python -m cosyedge_build.tools.device_lane_replay --bundle B [--bundle B2 ...] --out F.json"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.ort import OrtSession
from cosyedge_models.backends.ort_cache import DeviceCopier
from cosyedge_models.batching.batched_flow import BatchFlowGraphs, SlotCall, batch_flow_sessions
from cosyedge_models.batching.fused_step import load_fused_step
from cosyedge_models.bundle.loader import load_bundle

log = logging.getLogger(__name__)
PROFILED_CALLS = 5


def window_feeds(rng: np.random.Generator, channels: int, frames: int) -> dict[str, np.ndarray]:
    """One stream's window (its guidance pair), as the flow decoder feeds the estimator."""
    return {"x": rng.standard_normal((2, channels, frames)).astype(np.float32),
            "mask": np.ones((2, 1, frames), np.float32),
            "mu": rng.standard_normal((2, channels, frames)).astype(np.float32),
            "t": np.full(2, rng.random(), np.float32),
            "spks": rng.standard_normal((2, channels)).astype(np.float32),
            "cond": rng.standard_normal((2, channels, frames)).astype(np.float32)}


def _kernels(run: Callable[[], object]) -> dict[str, Any]:
    """Kernels one `run()` (a replay) launches and their GPU time (torch's profiler), or why not measured."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {"error": "torch is not installed"}
    try:
        torch.cuda.init()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_CALLS):
                run()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        names = Counter(e.name.split("<")[0][:60] for e in kernels)
        spent: Counter[str] = Counter()
        for e in kernels:
            spent[e.name.split("<")[0][:60]] += e.device_time
        return {"kernels_per_replay": len(kernels) / PROFILED_CALLS,
                "gpu_ms_per_replay": sum(e.device_time for e in kernels) / 1e3 / PROFILED_CALLS,
                "top_kernels": {k: v / PROFILED_CALLS for k, v in names.most_common(12)},
                # where a replay's GPU time goes: ms a replay by kernel name (the most first)
                "top_kernels_ms": {k: round(v / 1e3 / PROFILED_CALLS, 3) for k, v in spent.most_common(16)}}
    except Exception as exc:  # noqa: BLE001 - a profiler that cannot attach is reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


def cuda_ops(path: Path) -> dict[str, int]:
    """Nodes by operator of `path` as onnxruntime's CUDA provider optimizes it (no capture)."""
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    optimized = path.with_name(path.stem + ".cuda-opt.onnx")
    options.optimized_model_filepath = str(optimized)
    ort.InferenceSession(str(path), options, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    counts = Counter(n.op_type for n in onnx.load(str(optimized), load_external_data=False).graph.node)
    optimized.unlink()
    return dict(counts.most_common())


def measure(root: Path, backend_name: str, streams: Sequence[int], window: int, cached: int,
            calls: int, llm_length: int = 320) -> dict[str, Any]:
    bundle = load_bundle(root)
    backend = create_backend(backend_name)
    device = ("cuda", 0) if backend_name == "ort-cuda" else ("cpu", 0)
    sessions = {key: s for key, s in batch_flow_sessions(
        bundle, lambda name, path: backend.load(name, path, threads=1)).items()
        if key[1] == window and isinstance(s, OrtSession)}
    if not sessions:
        raise ValueError(f"{root}: no batched estimator graphs of window {window}")
    lanes = max(b for b, _ in sessions)
    graphs = BatchFlowGraphs(sessions, device, DeviceCopier(*device), lanes)
    t0 = time.perf_counter()
    graphs.warm_up()
    entry = next(e for n, e in bundle.manifest["stages"].items() if n.startswith("flow_estimator_batch_b"))
    report: dict[str, Any] = {"bundle": str(root), "backend": backend_name, "window": window, "cached_frames": cached,
                              "attention": entry.get("attention", "plain"), "precision": entry.get("precision"),
                              "lanes": lanes, "warm_up_s": round(time.perf_counter() - t0, 2), "streams": {}}
    rng = np.random.default_rng(0)
    channels = int(sessions[(1, window)].input_shapes["x"][1])
    for n in (s for s in streams if s <= lanes):
        for slot in range(n):
            graphs.reset(slot)
            graphs.lengths[slot] = min(cached, graphs.cache_frames)  # a voice prefix's frames (stale: masked)
        batch = [SlotCall(slot, window_feeds(rng, channels, window), 0) for slot in range(n)]
        graphs.run(batch)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            graphs.run(batch)
            times.append((time.perf_counter() - t) * 1e3)
        row: dict[str, Any] = {"run_ms_p50": round(statistics.median(times), 3),
                               "run_ms_mean": round(statistics.fmean(times), 3), "calls": calls}
        if device[0] == "cuda":
            row.update(_kernels(functools.partial(graphs.run, batch)))
        report["streams"][str(n)] = row
        log.info("%s: %d streams, %.2f ms a replay", root.name, n, row["run_ms_p50"])
    for s in sessions.values():
        s.close()
    if device[0] == "cuda":
        report["cuda_ops"] = cuda_ops(root / bundle.manifest["stages"][f"flow_estimator_batch_b1_w{window}"]["file"])
    llm = measure_llm_step(root, backend_name, calls, llm_length)
    if llm is not None:
        report["llm_step"] = llm
    return report


def measure_llm_step(root: Path, backend_name: str, calls: int, length: int) -> dict[str, Any] | None:
    """One fused batched LLM step of each batch size (every row's cache `length` positions long),
    timed call by call and, on a GPU, its kernels; None where the bundle has no fused step."""
    bundle = load_bundle(root)
    backend = create_backend(backend_name)
    device = ("cuda", 0) if backend_name == "ort-cuda" else ("cpu", 0)
    prefill = backend.load("llm_prefill", root / bundle.manifest["stages"]["llm_prefill"]["file"], threads=1)
    if not isinstance(prefill, OrtSession):
        raise ValueError(f"{backend_name}: the fused step needs onnxruntime sessions")
    step = load_fused_step(root, bundle.manifest, prefill, prefill.providers, device, threads=1)
    if step is None:
        prefill.close()
        return None
    try:
        t0 = time.perf_counter()
        step.warm_up()  # captures each batch size on ort-cuda (on this thread, which replays them)
        length = min(length, step.positions - 1)
        report: dict[str, Any] = {"kv_dtype": str(step.kv_dtype), "positions": step.positions,
                                  "cache_length": length, "warm_up_s": round(time.perf_counter() - t0, 2),
                                  "batches": {}}
        for b in step.batch_sizes:
            rows, lengths = list(range(b)), [length] * b
            embeds = np.zeros((b, bundle.llm.hidden_size), np.float32)
            run = functools.partial(step.step, rows, embeds, lengths, b)
            run()
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                run()
                times.append((time.perf_counter() - t) * 1e3)
            row: dict[str, Any] = {"run_ms_p50": round(statistics.median(times), 3),
                                   "run_ms_mean": round(statistics.fmean(times), 3), "calls": calls}
            if device[0] == "cuda":
                row.update(_kernels(run))
            report["batches"][str(b)] = row
            log.info("%s: fused LLM step of batch %d, %.2f ms", root.name, b, row["run_ms_p50"])
        return report
    finally:
        step.close()
        prefill.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_build.tools.device_lane_replay",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, action="append", required=True)
    p.add_argument("--backend", choices=("ort", "ort-cuda"), default="ort-cuda")
    p.add_argument("--streams", default="1,8,16", help="streams a replay serves, comma-separated")
    p.add_argument("--window", type=int, default=64, help="the batched graphs' window (frames)")
    p.add_argument("--cached", type=int, default=400, help="committed frames every lane holds")
    p.add_argument("--calls", type=int, default=50, help="timed replays per stream count")
    p.add_argument("--llm-length", type=int, default=320,
                   help="cache positions of every row in the fused LLM step's calls (a saved voice's prompt: ~291)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    streams = [int(s) for s in args.streams.split(",") if s.strip()]
    reports = [measure(b, args.backend, streams, args.window, args.cached, args.calls, args.llm_length)
               for b in args.bundle]
    args.out.write_text(json.dumps({"lane_replay": reports}, indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
