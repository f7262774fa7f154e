"""Fixed-shape flow estimator graphs for CUDA-graph replay (`build export
--static-flow-windows`).

The dynamic estimator (flow_estimator.py) has ~1,000 shape nodes per call
that onnxruntime runs on the CPU, so it cannot be captured as a CUDA graph
and costs 20-25 ms a step on an H200 whatever the window. These graphs have
only static shapes, one per window size W (a bucket: shorter windows are
right-padded with mask 0, which is exact: the convolutions are causal and
padded keys are masked), over a fixed-size cache of S frames:

* x, mu, cond [2, C, W], mask [2, 1, W], t [2], spks [2, C]: as the dynamic graph
  (the chunk size is the bundle's streaming chunk, baked in).
* att_cache [S, L, 2, 2, H, D] with cache_valid [S] (1: a committed frame to
  attend to, 0: free or dropped): the cache is one preallocated buffer.
* conv_cache [K, 2, Cmax, 2]; commit_index [2] int64: the conv-input frames
  (history first) that become the next history, i.e. commit + [0, 1].
* dphi_dt [2, C, W]; att_window [W, L, 2, 2, H, D]: K/V of every window frame
  (the runtime copies the committed ones into the cache); conv_cache_new.

models/backends/ort_static_flow.py replays them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cosyedge_build.export.flow_estimator import _torch, cache_dims, make_estimator_graph
from cosyedge_build.export.graphs import StageGraph, TensorSpec, export_stage, module_base
from cosyedge_models.bundle.loader import STATIC_FLOW_PREFIX

CFG_ROWS = 2


def stage_name(window: int) -> str:
    return f"{STATIC_FLOW_PREFIX}{window}"


def make_static_graph(estimator: Any, chunk_frames: int) -> Any:
    torch = _torch()
    inner = make_estimator_graph(estimator)
    hist = cache_dims(estimator)["conv_history"]

    class StaticEstimatorGraph(module_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Any, mask: Any, mu: Any, t: Any, spks: Any, cond: Any, att_cache: Any,
                    cache_valid: Any, conv_cache: Any, commit_index: Any) -> tuple[Any, Any, Any]:
            chunk = torch.full((x.shape[0],), chunk_frames, dtype=torch.int64)
            # every window frame's K/V is returned (att_window): no index_select
            return self.inner.core(x, mask, mu, t, spks, cond, chunk, att_cache, conv_cache, None,
                                   commit_index[:hist], cache_valid)

    return StaticEstimatorGraph().eval()


def export_static_estimators(flow: Any, out: Path, windows: list[int], cache_frames: int,
                             chunk_frames: int) -> list[StageGraph]:
    """One graph per window size over a cache of `cache_frames` frames."""
    torch = _torch()
    estimator = flow.decoder.estimator
    c = int(estimator.out_channels)
    dims = cache_dims(estimator)
    if not dims["stream_cache"]:
        raise ValueError("fixed-shape estimator graphs need a chunk-causal estimator (single-level U-Net)")
    if cache_frames < 1 or any(w < 1 for w in windows):
        raise ValueError(f"static flow windows and cache must be >= 1 frame, got {windows} and {cache_frames}")
    row = (dims["blocks"], 2, CFG_ROWS, dims["heads"], dims["head_dim"])
    conv = (dims["convs"], CFG_ROWS, dims["conv_channels"], dims["conv_history"])
    graph = make_static_graph(estimator, chunk_frames)
    stages = []
    for w in sorted(set(windows)):
        stage = StageGraph(
            stage_name(w), f"{stage_name(w)}.onnx",
            [
                TensorSpec("x", "float32", (CFG_ROWS, c, w)),
                TensorSpec("mask", "float32", (CFG_ROWS, 1, w)),
                TensorSpec("mu", "float32", (CFG_ROWS, c, w)),
                TensorSpec("t", "float32", (CFG_ROWS,)),
                TensorSpec("spks", "float32", (CFG_ROWS, c)),
                TensorSpec("cond", "float32", (CFG_ROWS, c, w)),
                TensorSpec("att_cache", "float32", (cache_frames, *row)),
                TensorSpec("cache_valid", "float32", (cache_frames,)),
                TensorSpec("conv_cache", "float32", conv),
                TensorSpec("commit_index", "int64", (dims["conv_history"],)),
            ],
            [
                TensorSpec("dphi_dt", "float32", (CFG_ROWS, c, w)),
                TensorSpec("att_window", "float32", (w, *row)),
                TensorSpec("conv_cache_new", "float32", conv),
            ],
            {},
            extra={"window": w, "cache_frames": cache_frames, "chunk_frames": chunk_frames, "cache": dims},
        )
        mask = torch.ones(CFG_ROWS, 1, w)
        mask[:, :, w - w // 4:] = 0  # traced with padding, so nothing folds to "all valid"
        valid = torch.zeros(cache_frames)
        valid[: cache_frames // 2] = 1
        example = (torch.randn(CFG_ROWS, c, w), mask, torch.randn(CFG_ROWS, c, w), torch.rand(CFG_ROWS),
                   torch.randn(CFG_ROWS, c), torch.randn(CFG_ROWS, c, w), torch.randn(cache_frames, *row), valid,
                   torch.randn(*conv), torch.tensor([3, 4]))
        stages.append(export_stage(graph, example, out, stage))
    return stages
