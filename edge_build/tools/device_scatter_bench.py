"""What writing a window's K/V into the lanes' buffers costs on onnxruntime, operator alone: the fused
batched estimator replay spends ~46 % of its GPU time in its 112 ScatterND kernels (H200, fourteenth
run, docs/gpu.md): onnxruntime's CUDA ScatterND gives each index one thread that copies the index's
whole slice (a head's 64 values) element after element. This times the ways to write the same
values in place, each as a graph of `--scatters` writes into their own buffers bound as input and
output (as the lanes are), for a batch of 1 and of 16 streams:

* `nd64`: ScatterND on [N, H, F, D] over (row, head, frame) indices, slices of D values (today's);
* `nd8`: ScatterND on the same memory declared [N, H, F, D/8, 8], (row, head, frame, part) indices,
  slices of 8 values;
* `nd8_reshaped`: `nd8` behind a Reshape of the [N, H, F, D] buffers (whether onnxruntime keeps it in
  place: a copy of the buffer shows as memcpy time);
* `elements`: ScatterElements along the frames, one int32 index per value (the updates in
  [N, H, W, D]: a transpose more in a real graph).

    python -m cosyedge_build.tools.device_scatter_bench --out F.json [--backend ort|ort-cuda]"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

VARIANTS = ("nd64", "nd8", "nd8_reshaped", "elements")
PART = 8  # values a ScatterND slice copies in the nd8 variants


def shapes(variant: str, n: int, heads: int, frames: int, dim: int, window: int) -> dict[str, tuple[int, ...]]:
    """The declared shapes of a variant's buffer, indices and updates."""
    full = (n, heads, frames, dim)
    if variant == "nd64":
        return {"data": full, "indices": (n, window, heads, 3), "updates": (n, window, heads, dim)}
    if variant in ("nd8", "nd8_reshaped"):
        split = (n, heads, frames, dim // PART, PART)
        return {"data": full if variant == "nd8_reshaped" else split,
                "indices": (n, window, heads, dim // PART, 4), "updates": (n, window, heads, dim // PART, PART)}
    if variant == "elements":
        return {"data": full, "indices": (n, heads, window, dim), "updates": (n, heads, window, dim)}
    raise ValueError(f"scatter variant {variant!r} is not one of {', '.join(VARIANTS)}")


def indices(variant: str, n: int, heads: int, dim: int, window: int, length: int) -> np.ndarray:
    """Where each variant writes frame w of every row and head: frame `length` + w."""
    rows, hs, ws = np.meshgrid(np.arange(n), np.arange(heads), np.arange(window), indexing="ij")  # [N, H, W]
    at = length + ws
    if variant == "nd64":
        return np.stack([rows, hs, at], -1).transpose(0, 2, 1, 3).astype(np.int64)  # [N, W, H, 3]
    if variant in ("nd8", "nd8_reshaped"):
        parts = dim // PART
        grid = [np.broadcast_to(a[..., None], (*a.shape, parts)) for a in (rows, hs, at)]
        idx = np.stack([*grid, np.broadcast_to(np.arange(parts), (n, heads, window, parts))], -1)
        return idx.transpose(0, 2, 1, 3, 4).astype(np.int64)  # [N, W, H, D/8, 4]
    return np.broadcast_to(at[..., None], (n, heads, window, dim)).astype(np.int32)  # [N, H, W, D]


def updates_of(variant: str, k: np.ndarray) -> np.ndarray:
    """The window's values k [N, W, H, D] as a variant's updates."""
    n, w, h, d = k.shape
    if variant == "nd64":
        return k
    if variant in ("nd8", "nd8_reshaped"):
        return k.reshape(n, w, h, d // PART, PART)
    return np.ascontiguousarray(k.transpose(0, 2, 1, 3))


def graph(variant: str, scatters: int, n: int, heads: int, frames: int, dim: int, window: int) -> bytes:
    """`scatters` writes, buffer `cache_<i>` into `cache_out_<i>`, sharing one indices and one updates input."""
    from onnx import TensorProto, helper

    shp = shapes(variant, n, heads, frames, dim, window)
    f16, index_type = TensorProto.FLOAT16, TensorProto.INT32 if variant == "elements" else TensorProto.INT64
    nodes, inits = [], []
    if variant == "nd8_reshaped":
        inits += [helper.make_tensor("split", TensorProto.INT64, [5], [n, heads, frames, dim // PART, PART]),
                  helper.make_tensor("whole", TensorProto.INT64, [4], [n, heads, frames, dim])]
    for i in range(scatters):
        src, dst = f"cache_{i}", f"cache_out_{i}"
        if variant == "elements":
            nodes.append(helper.make_node("ScatterElements", [src, "indices", "updates"], [dst], axis=2))
        elif variant == "nd8_reshaped":
            nodes += [helper.make_node("Reshape", [src, "split"], [f"s{i}"]),
                      helper.make_node("ScatterND", [f"s{i}", "indices", "updates"], [f"w{i}"]),
                      helper.make_node("Reshape", [f"w{i}", "whole"], [dst])]
        else:
            nodes.append(helper.make_node("ScatterND", [src, "indices", "updates"], [dst]))
    inputs = [helper.make_tensor_value_info(f"cache_{i}", f16, shp["data"]) for i in range(scatters)]
    inputs += [helper.make_tensor_value_info("indices", index_type, shp["indices"]),
               helper.make_tensor_value_info("updates", f16, shp["updates"])]
    outputs = [helper.make_tensor_value_info(f"cache_out_{i}", f16, shp["data"]) for i in range(scatters)]
    model = helper.make_model(helper.make_graph(nodes, variant, inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=9)  # onnxruntime 1.31 reads <= 13
    return bytes(model.SerializeToString())


def run_variant(variant: str, backend: str, scatters: int, n: int, heads: int, frames: int, dim: int, window: int,
                length: int, calls: int, seed: int = 0) -> tuple[dict[str, Any], list[np.ndarray]]:
    """One variant timed call by call (buffers bound in place); its report and its buffers after the calls."""
    import onnxruntime as ort

    kind = "cuda" if backend == "ort-cuda" else "cpu"
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if kind == "cuda" else ["CPUExecutionProvider"]
    options = ort.SessionOptions()
    options.log_severity_level = 3  # not ScatterND's duplicate-index warning once per node and call
    session = ort.InferenceSession(graph(variant, scatters, n, heads, frames, dim, window), options,
                                   providers=providers)
    rng = np.random.default_rng(seed)
    shp = shapes(variant, n, heads, frames, dim, window)
    k = rng.standard_normal((n, window, heads, dim)).astype(np.float16)
    caches = [ort.OrtValue.ortvalue_from_numpy(rng.standard_normal(shp["data"]).astype(np.float16), kind, 0)
              for _ in range(scatters)]
    binding = session.io_binding()
    fixed = {"indices": indices(variant, n, heads, dim, window, length), "updates": updates_of(variant, k)}
    for name, value in fixed.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), kind, 0))
    for i, cache in enumerate(caches):
        binding.bind_ortvalue_input(f"cache_{i}", cache)
        binding.bind_ortvalue_output(f"cache_out_{i}", cache)  # in place, as the lanes
    session.run_with_iobinding(binding)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append((time.perf_counter() - t) * 1e3)
    report: dict[str, Any] = {"variant": variant, "streams": n // 2, "rows": n, "scatters": scatters,
                              "run_ms_p50": round(statistics.median(times), 3)}
    if kind == "cuda":
        report.update(_profile(session, binding, scatters))
    return report, [np.array(c.numpy()) for c in caches]  # copies: the OrtValues go with this frame


def _profile(session: Any, binding: Any, scatters: int) -> dict[str, Any]:
    """GPU time of a call by kernel name (torch's profiler), or why not measured."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {"error": "torch is not installed"}
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            session.run_with_iobinding(binding)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    spent: Counter[str] = Counter()
    for e in events:
        spent[e.name.split("<")[0][:60]] += e.device_time
    total_us = sum(e.device_time for e in events) / 3
    return {"gpu_ms": round(total_us / 1e3, 3), "gpu_us_per_scatter": round(total_us / scatters, 2),
            "events_per_call": len(events) / 3,
            "gpu_ms_by_name": {k: round(v / 3e3, 3) for k, v in spent.most_common(6)}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_build.tools.device_scatter_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("ort", "ort-cuda"), default="ort-cuda")
    p.add_argument("--streams", default="1,16", help="streams a call serves (rows: 2 a stream), comma-separated")
    p.add_argument("--scatters", type=int, default=112, help="writes a call (full size: 56 blocks' K and V)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--frames", type=int, default=1152, help="buffer frames (cache 1024 + the largest window 128)")
    p.add_argument("--dim", type=int, default=64, help="head size")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--length", type=int, default=400, help="committed frames of every row (where the window goes)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    reports = []
    for streams in (int(s) for s in args.streams.split(",") if s.strip()):
        for variant in VARIANTS:
            report, _ = run_variant(variant, args.backend, args.scatters, 2 * streams, args.heads, args.frames,
                                    args.dim, args.window, length=args.length, calls=args.calls)
            reports.append(report)
            print(json.dumps(report))
            # after every variant: a call cut short keeps what it measured
            args.out.write_text(json.dumps({"scatter_bench": reports}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
