"""Fixed-length vocoder graphs for CUDA-graph replay (`build export --static-vocoder`).

Streaming repeats two mel lengths in every stream: the first chunk (the
first hop's frames) and the steady chunk (a hop's frames after the kept mel
overlap). For each, one graph of hift_source and hift_decoder together with
only static shapes, so onnxruntime's CUDA provider can capture it and a
chunk's vocoder is one launch (the dynamic pair is two sessions with shape
arithmetic on the host). The lengths are exact, not buckets: HiFT's
convolutions are not causal, so padding would change the audio.

* mel [1, C, N], noise [1, N*U, H]: as hift_source.
* cache_source [1, 1, L] and cache_on [1]: the previous chunk's source tail
  (L = the bundle's source_cache_len) replaces the head of this chunk's
  source when cache_on is 1, as the runtime does between the two dynamic
  stages (cache_on 0: the first chunk).
* audio [1, N*U]; source [1, 1, N*U] (its tail is the next chunk's cache).

With --batch-flow-sizes too, the same graph over B rows (`hift_batch_b<B>_f<N>`,
B > 1): each row its own mel, noise, source cache and cache_on, so that several
streams' chunks of one length (a first chunk beside later ones) are one replay.
HiFT mixes nothing across rows.

models/backends/ort_static_vocoder.py replays them; models/batching/batched_vocoder.py
the batched ones."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cosyedge_build.export.graphs import StageGraph, TensorSpec, export_stage, module_base
from cosyedge_build.export.hift import _torch, make_decoder_graph, make_source_graph, upsample_factor
from cosyedge_models.bundle.loader import BATCH_VOCODER_PREFIX, STATIC_VOCODER_PREFIX
from cosyedge_models.synthesis.streaming import recurring_mel_frames


def stage_name(frames: int) -> str:
    return f"{STATIC_VOCODER_PREFIX}{frames}"


def make_static_vocoder(hift: Any, cache_len: int) -> Any:
    torch = _torch()
    source_graph, decoder_graph = make_source_graph(hift), make_decoder_graph(hift)

    class StaticVocoderGraph(module_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.source_graph = source_graph
            self.decoder_graph = decoder_graph

        def forward(self, mel: Any, noise: Any, cache_source: Any, cache_on: Any) -> tuple[Any, Any]:
            source = self.source_graph(mel, noise)
            on = cache_on.view(-1, 1, 1)  # a row's own switch
            head = on * cache_source + (1.0 - on) * source[:, :, :cache_len]  # exact for 0 and 1
            source = torch.cat([head, source[:, :, cache_len:]], dim=2)
            return self.decoder_graph(mel, source), source

    return StaticVocoderGraph().eval()


def static_vocoder_frames(streaming: dict[str, Any], token_mel_ratio: int,
                          first_hops: Sequence[int] = (), hops: Sequence[int] = ()) -> list[int]:
    """The mel lengths to export: the recurring ones of the engine's default schedule, the
    first chunk of each of `first_hops` (speech tokens: the engine's `first_hop_tokens`), which a
    device that answers sooner repeats in every stream, and both chunks of each of `hops` (the later
    hops a growing schedule reaches, `hop_scale` with `max_hop_tokens`: its steady chunk, and an offline
    request's first chunk, which starts there: ChunkSchedule.grown_start)."""
    hop, mel_cache = int(streaming["token_hop_len"]), int(streaming["mel_cache_len"])
    lengths = set(recurring_mel_frames(hop, token_mel_ratio, mel_cache))
    for first_hop in first_hops:
        lengths.add(recurring_mel_frames(hop, token_mel_ratio, mel_cache, first_hop)[0])
    for later in hops:
        lengths.update(recurring_mel_frames(later, token_mel_ratio, mel_cache))
    return sorted(lengths)


def batch_stage_name(batch: int, frames: int) -> str:
    return f"{BATCH_VOCODER_PREFIX}{batch}_f{frames}"


def export_static_vocoder(hift: Any, out: Path, frames: list[int], cache_len: int,
                          batch_sizes: Sequence[int] = ()) -> list[StageGraph]:
    """One graph per mel length, and per length one per batch size above 1 in `batch_sizes` (the
    streams' chunks of that length in one replay); each chunk must be longer than the source cache."""
    torch = _torch()
    c = int(hift.f0_predictor.condnet[0].in_channels)
    factor = upsample_factor(hift)
    harmonics = int(hift.nb_harmonics) + 1
    if any(n * factor <= cache_len for n in frames):
        raise ValueError(f"static vocoder lengths {frames} must exceed the source cache ({cache_len} samples)")
    graph = make_static_vocoder(hift, cache_len)
    stages = []
    for b in [1, *sorted({int(b) for b in batch_sizes if int(b) > 1})]:
        for n in frames:
            name = stage_name(n) if b == 1 else batch_stage_name(b, n)
            stage = StageGraph(
                name, f"{name}.onnx",
                [TensorSpec("mel", "float32", (b, c, n)), TensorSpec("noise", "float32", (b, n * factor, harmonics)),
                 TensorSpec("cache_source", "float32", (b, 1, cache_len)), TensorSpec("cache_on", "float32", (b,))],
                [TensorSpec("audio", "float32", (b, n * factor)), TensorSpec("source", "float32", (b, 1, n * factor))],
                {},
                extra={"frames": n, "cache_len": cache_len, **({"batch": b} if b > 1 else {})},
            )
            example = (torch.randn(b, c, n), torch.randn(b, n * factor, harmonics),
                       torch.randn(b, 1, cache_len) * 0.1,
                       torch.full((b,), 0.5))  # not 0 or 1: nothing folds away in the trace
            stages.append(export_stage(graph, example, out, stage))
    return stages
