"""Streaming flow encoder windows batched across streams (`flow_encoder_batch_b<B>_t<T>`, one graph
per batch size B and window T tokens; exported with the batched estimator windows, `build export
--batch-flow-sizes`), beside the single-stream graphs of flow_encoder_static.py, which stay.

The single-stream graphs serve one request a call; at eight streams the first chunks' encoder calls
ran one after another on the graph thread (~8 ms each on the H200, sixteenth run). A call of these
serves B streams, each with its own tokens, look-ahead, speaker embedding, committed length and
commit, at one window size (shorter windows right-padded, exact as in the single-stream graphs).
Each stream's caches live in a lane of one buffer per cache, bound by every graph:

* enc_lanes [N, S, L1, H2] and up_lanes [N, r*S, L2, H2] (H2 = 2 * heads * head_dim: a token's K|V
  of every head, the single-stream row [L, 2, 1, H, D] flattened past L), pre_lanes [N, C1, K1],
  upconv_lanes [N, C2, K2]: N lanes (the largest batch size), lane-major so that a lane's rows are
  contiguous and a commit is one device copy per cache;
* lane [B]: the lane each row reads (gathered in the graph: the batch's streams need not sit in
  lanes 0..B-1, and a padded row may read any lane, its outputs unused);
* token [B, T], token_len, lookahead_len, cached_len, commit_tokens [B], embedding [B, E].

Outputs, row-major so that each row's part is contiguous: mu [B, C, r*T], spks [B, C],
enc_window [B, T, L1, H2], up_window [B, r*T, L2, H2], pre_cache_new, upconv_cache_new [B, C, K].
The runtime (models/batching/batched_encoder.py) copies each row's committed rows and histories
into its lane after the replay, as the single-stream runtime does into its slot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cosyedge_build.export.flow_encoder import _torch, encoder_cache_dims, make_flow_encoder_graph
from cosyedge_build.export.graphs import StageGraph, TensorSpec, export_stage, module_base
from cosyedge_models.bundle.loader import BATCH_ENCODER_PREFIX
from cosyedge_models.errors import CheckpointError


def stage_name(batch: int, window_tokens: int) -> str:
    return f"{BATCH_ENCODER_PREFIX}{batch}_t{window_tokens}"


def make_batch_encoder_graph(flow: Any, chunk_tokens: int) -> Any:
    torch = _torch()
    inner = make_flow_encoder_graph(flow)
    dims = encoder_cache_dims(flow)
    heads, head_dim = dims["heads"], dims["head_dim"]

    def rows(lanes: Any, lane: Any) -> Any:
        """[N, S, L, 2*H*D] lanes -> the rows' caches [S, L, 2, B, H, D] as the core takes them."""
        _, s, layers, _ = lanes.shape
        picked = lanes.index_select(0, lane).view(lane.shape[0], s, layers, 2, heads, head_dim)
        return picked.permute(1, 2, 3, 0, 4, 5)

    def row_major(window: Any) -> Any:
        """The core's [T, L, 2, B, H, D] -> [B, T, L, 2*H*D]."""
        t, layers, _, b, _, _ = window.shape
        return window.permute(3, 0, 1, 2, 4, 5).reshape(b, t, layers, 2 * heads * head_dim)

    class BatchFlowEncoderGraph(module_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, token: Any, token_len: Any, lookahead_len: Any, embedding: Any, enc_lanes: Any,
                    up_lanes: Any, pre_lanes: Any, upconv_lanes: Any, lane: Any, cached_len: Any,
                    commit_tokens: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
            chunk = torch.full((1,), chunk_tokens, dtype=torch.int64)
            mu, spks, enc, up, pre, upconv = self.inner.core(
                token, token_len, lookahead_len, chunk, embedding, rows(enc_lanes, lane), rows(up_lanes, lane),
                pre_lanes.index_select(0, lane), upconv_lanes.index_select(0, lane), commit_tokens, None, None,
                cached_len)
            return mu, spks, row_major(enc), row_major(up), pre, upconv

    return BatchFlowEncoderGraph().eval()


def export_batch_encoders(flow: Any, out: Path, batch_sizes: list[int], windows: list[int], cache_tokens: int,
                          chunk_tokens: int) -> list[StageGraph]:
    """One graph per (batch size, window) over `max(batch_sizes)` lanes of `cache_tokens` tokens."""
    torch = _torch()
    if chunk_tokens <= 0:
        raise CheckpointError("batched flow encoder graphs need a streaming chunk (flow chunk_tokens > 0)")
    if not batch_sizes or min(batch_sizes) < 1 or cache_tokens < 1 or any(w < 1 for w in windows):
        raise ValueError(f"batched encoder sizes {batch_sizes}, windows {windows} and cache {cache_tokens} "
                         "must be >= 1")
    d = encoder_cache_dims(flow)
    ratio = int(flow.encoder.up_layer.stride)
    mel, spk = int(flow.output_size), int(flow.spk_embed_affine_layer.in_features)
    row = 2 * d["heads"] * d["head_dim"]
    lanes = max(batch_sizes)
    enc = (lanes, cache_tokens, d["layers"], row)
    up = (lanes, cache_tokens * ratio, d["up_layers"], row)
    pre = (lanes, d["pre_channels"], d["pre_history"])
    upconv = (lanes, d["upconv_channels"], d["upconv_history"])
    graph = make_batch_encoder_graph(flow, chunk_tokens)
    stages = []
    for b in sorted(set(batch_sizes)):
        for t in sorted(set(windows)):
            stage = StageGraph(
                stage_name(b, t), f"{stage_name(b, t)}.onnx",
                [
                    TensorSpec("token", "int64", (b, t)),
                    TensorSpec("token_len", "int64", (b,)),
                    TensorSpec("lookahead_len", "int64", (b,)),
                    TensorSpec("embedding", "float32", (b, spk)),
                    TensorSpec("enc_lanes", "float32", enc),
                    TensorSpec("up_lanes", "float32", up),
                    TensorSpec("pre_lanes", "float32", pre),
                    TensorSpec("upconv_lanes", "float32", upconv),
                    TensorSpec("lane", "int64", (b,)),
                    TensorSpec("cached_len", "int64", (b,)),
                    TensorSpec("commit_tokens", "int64", (b,)),
                ],
                [
                    TensorSpec("mu", "float32", (b, mel, ratio * t)),
                    TensorSpec("spks", "float32", (b, mel)),
                    TensorSpec("enc_window", "float32", (b, t, d["layers"], row)),
                    TensorSpec("up_window", "float32", (b, ratio * t, d["up_layers"], row)),
                    TensorSpec("pre_cache_new", "float32", (b, *pre[1:])),
                    TensorSpec("upconv_cache_new", "float32", (b, *upconv[1:])),
                ],
                {},
                extra={"batch": b, "window_tokens": t, "lanes": lanes, "cache_tokens": cache_tokens,
                       "chunk_tokens": chunk_tokens, "cache": d},
            )
            # rows of different lengths, look-aheads and commits, so that nothing folds to a constant
            example = (
                torch.randint(0, int(flow.vocab_size), (b, t)),
                torch.tensor([max(t - (t * (i + 1)) // (b + 3), 1) for i in range(b)]),
                torch.tensor([min(i % 4, t - 1) for i in range(b)]),
                torch.randn(b, spk),
                torch.randn(*enc),
                torch.randn(*up),
                torch.randn(*pre),
                torch.randn(*upconv),
                torch.tensor([(lanes - 1 - i) % lanes for i in range(b)]),
                torch.tensor([(cache_tokens * (i + 1)) // (b + 2) for i in range(b)]),
                torch.tensor([min(chunk_tokens, t // 2) - (i % 2) for i in range(b)]).clamp(min=0),
            )
            stages.append(export_stage(graph, example, out, stage))
    return stages
