"""The flow and vocoder half of `cosyedge build export` (everything after the LLM): in the exporting
process, or with `--jobs 2` in a second process beside the LLM half. The two halves read the same
checkpoint and write different files into the same scratch folder; on a 16-core GPU host the LLM half
(~220 s at full size) and this one (~200 s) then take the time of the longer one. Off by default: a
second process holds a second copy of the reference modules, which an 8 GB board cannot spare."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyedge_build.export.graphs import StageGraph


@dataclass(frozen=True)
class FlowSideOptions:
    """export_bundle's flow and vocoder options (its docstring says what each adds; its defaults)."""

    static_flow_windows: tuple[int, ...]
    static_flow_cache: int
    static_vocoder: bool
    static_vocoder_first_hops: tuple[int, ...]
    batch_flow_sizes: tuple[int, ...]
    batch_flow_precision: str
    batch_flow_attention: str
    static_vocoder_hops: tuple[int, ...] = ()


def export_flow_side(flow: Any, vocoder: Any, scratch: Path, hyper: dict[str, Any],
                     opts: FlowSideOptions, advance: Callable[[str], None] = lambda _stage: None,
                     ) -> tuple[list[StageGraph], dict[str, Path]]:
    """The flow encoder, the estimator (and their fixed-shape and batched windows) and the vocoder graphs
    of the reference modules `flow` and `vocoder` (HiFT) into `scratch`; returns their stages and the flow's noise.
    `advance` is told each part's end (the export's progress)."""
    from cosyedge_build.export import (
        flow_batch,
        flow_encoder,
        flow_encoder_batch,
        flow_encoder_static,
        flow_estimator,
        flow_static,
        hift,
        hift_static,
    )

    stages = [flow_encoder.export_flow_encoder(flow, scratch)]
    advance("flow encoder")
    estimator_stage, noise = flow_estimator.export_flow_estimator(flow, scratch)
    stages.append(estimator_stage)
    windows = list(opts.static_flow_windows)
    batches = list(opts.batch_flow_sizes)
    if windows:
        chunk = int(hyper["flow"]["chunk_tokens"]) * int(hyper["token_mel_ratio"])  # as FlowStream
        stages.extend(flow_static.export_static_estimators(flow, scratch, windows, opts.static_flow_cache, chunk))
        if batches:
            stages.extend(flow_batch.export_batch_estimators(
                flow, scratch, batches, windows, opts.static_flow_cache, chunk, opts.batch_flow_precision,
                opts.batch_flow_attention))
        # and the streaming encoder over the same windows (tokens, look-ahead included)
        ratio, flow_hyper = int(hyper["token_mel_ratio"]), hyper["flow"]
        enc_windows = flow_encoder_static.encoder_windows(windows, ratio, int(flow_hyper["pre_lookahead_len"]))
        stages.extend(flow_encoder_static.export_static_encoders(
            flow, scratch, enc_windows, opts.static_flow_cache // ratio, int(flow_hyper["chunk_tokens"])))
        if batches:  # the encoder windows batched the same way
            stages.extend(flow_encoder_batch.export_batch_encoders(
                flow, scratch, batches, enc_windows, opts.static_flow_cache // ratio,
                int(flow_hyper["chunk_tokens"])))
    advance("flow estimator")
    stages.extend(hift.export_hift(vocoder, scratch))
    if opts.static_vocoder:
        frames = hift_static.static_vocoder_frames(hyper["streaming"], int(hyper["token_mel_ratio"]),
                                                   opts.static_vocoder_first_hops, opts.static_vocoder_hops)
        # with --batch-flow-sizes, the streams' chunks of a length batched the same way
        stages.extend(hift_static.export_static_vocoder(vocoder, scratch, frames,
                                                        int(hyper["streaming"]["source_cache_len"]), batches))
    advance("vocoder")
    return stages, {"flow_noise": noise}


def export_flow_side_from(model_dir: Path, scratch: Path, hyper: dict[str, Any],
                          opts: FlowSideOptions) -> tuple[list[StageGraph], dict[str, Path]]:
    """export_flow_side in a process of its own: loads the reference modules from `model_dir` itself."""
    import cosyedge_build.reference.modules as reference

    refs = reference.load_reference(model_dir)
    return export_flow_side(refs.flow, refs.hift, scratch, hyper, opts)
