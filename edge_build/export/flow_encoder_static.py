"""Fixed-shape streaming flow encoder graphs for CUDA-graph replay (exported
with the fixed-shape estimator graphs, `build export --static-flow-windows`).

The dynamic encoder (flow_encoder.py) runs once per streaming chunk with ~200
of its ~980 nodes on the CPU and 14 host/device copies a call (its caches go
to the device and back every call), so onnxruntime cannot capture it. These
graphs serve one streaming request, one window size T (tokens, look-ahead
included; a bucket: shorter windows are right-padded, which is exact: padded
tokens are zeroed, masked as keys, the convolutions are causal and their
frames are dropped) over caches of a fixed size with only static shapes:

* token [1, T], token_len [1], lookahead_len [1], embedding [1, E]: as the
  dynamic graph; the chunk size is the bundle's streaming chunk, baked in.
* enc_cache [S, L1, 2, 1, H, D] and up_cache [r*S, L2, 2, 1, H, D] with
  cached_len [1] (the committed tokens: rows from cached_len on are free and
  masked; the ESPnet relative positions are taken from cached_len, so the
  rows stay left-aligned and a commit is an append), pre_cache, upconv_cache.
* commit_tokens [1]: the window's first tokens that this call commits (the
  conv histories are taken after them).
* mu [1, C, r*T], spks, enc_window [T, ...] and up_window [r*T, ...]: the K/V
  of every window row (the runtime copies the committed ones into its
  buffers), pre_cache_new, upconv_cache_new.

models/backends/ort_static_encoder.py replays them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cosyedge_build.export.flow_encoder import _torch, encoder_cache_dims, make_flow_encoder_graph
from cosyedge_build.export.graphs import StageGraph, TensorSpec, export_stage, module_base
from cosyedge_models.bundle.loader import STATIC_ENCODER_PREFIX
from cosyedge_models.errors import CheckpointError


def stage_name(window_tokens: int) -> str:
    return f"{STATIC_ENCODER_PREFIX}{window_tokens}"


def encoder_windows(estimator_windows: list[int], token_mel_ratio: int, lookahead: int) -> list[int]:
    """The encoder window (tokens, look-ahead included) for each estimator window (mel
    frames): a streaming call's encoder and estimator windows start and end together."""
    if any(w % token_mel_ratio for w in estimator_windows):
        raise ValueError(f"fixed-shape flow windows {estimator_windows} must be multiples of the token/mel "
                         f"ratio {token_mel_ratio}")
    return sorted({w // token_mel_ratio + lookahead for w in estimator_windows})


def make_static_encoder_graph(flow: Any, chunk_tokens: int) -> Any:
    torch = _torch()
    inner = make_flow_encoder_graph(flow)

    class StaticFlowEncoderGraph(module_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, token: Any, token_len: Any, lookahead_len: Any, embedding: Any, enc_cache: Any,
                    up_cache: Any, pre_cache: Any, upconv_cache: Any, cached_len: Any,
                    commit_tokens: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
            chunk = torch.full((1,), chunk_tokens, dtype=torch.int64)
            return self.inner.core(token, token_len, lookahead_len, chunk, embedding, enc_cache, up_cache,
                                   pre_cache, upconv_cache, commit_tokens, None, None, cached_len)

    return StaticFlowEncoderGraph().eval()


def export_static_encoders(flow: Any, out: Path, windows: list[int], cache_tokens: int,
                           chunk_tokens: int) -> list[StageGraph]:
    """One graph per window size (tokens) over caches of `cache_tokens` committed tokens."""
    torch = _torch()
    if chunk_tokens <= 0:
        raise CheckpointError("fixed-shape flow encoder graphs need a streaming chunk (flow chunk_tokens > 0)")
    if cache_tokens < 1 or any(w < 1 for w in windows):
        raise ValueError(f"static encoder windows and cache must be >= 1 token, got {windows} and {cache_tokens}")
    d = encoder_cache_dims(flow)
    ratio = int(flow.encoder.up_layer.stride)
    mel, spk = int(flow.output_size), int(flow.spk_embed_affine_layer.in_features)
    kv = (2, 1, d["heads"], d["head_dim"])
    enc = (cache_tokens, d["layers"], *kv)
    up = (cache_tokens * ratio, d["up_layers"], *kv)
    pre = (1, d["pre_channels"], d["pre_history"])
    upconv = (1, d["upconv_channels"], d["upconv_history"])
    graph = make_static_encoder_graph(flow, chunk_tokens)
    stages = []
    for t in sorted(set(windows)):
        stage = StageGraph(
            stage_name(t), f"{stage_name(t)}.onnx",
            [
                TensorSpec("token", "int64", (1, t)),
                TensorSpec("token_len", "int64", (1,)),
                TensorSpec("lookahead_len", "int64", (1,)),
                TensorSpec("embedding", "float32", (1, spk)),
                TensorSpec("enc_cache", "float32", enc),
                TensorSpec("up_cache", "float32", up),
                TensorSpec("pre_cache", "float32", pre),
                TensorSpec("upconv_cache", "float32", upconv),
                TensorSpec("cached_len", "int64", (1,)),
                TensorSpec("commit_tokens", "int64", (1,)),
            ],
            [
                TensorSpec("mu", "float32", (1, mel, ratio * t)),
                TensorSpec("spks", "float32", (1, mel)),
                TensorSpec("enc_window", "float32", (t, d["layers"], *kv)),
                TensorSpec("up_window", "float32", (ratio * t, d["up_layers"], *kv)),
                TensorSpec("pre_cache_new", "float32", pre),
                TensorSpec("upconv_cache_new", "float32", upconv),
            ],
            {},
            extra={"window_tokens": t, "cache_tokens": cache_tokens, "chunk_tokens": chunk_tokens, "cache": d},
        )
        # traced with padding, a part-used cache and a commit, so that nothing folds to a constant
        example = (
            torch.randint(0, int(flow.vocab_size), (1, t)),
            torch.tensor([max(t - t // 4, 1)]),
            torch.tensor([min(3, t - 1)]),
            torch.randn(1, spk),
            torch.randn(*enc),
            torch.randn(*up),
            torch.randn(*pre),
            torch.randn(*upconv),
            torch.tensor([cache_tokens // 2]),
            torch.tensor([min(chunk_tokens, t // 2)]),
        )
        stages.append(export_stage(graph, example, out, stage))
    return stages
