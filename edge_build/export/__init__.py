"""`cosyedge build export`: a CosyVoice 2 checkpoint directory to a model
bundle (models/bundle/BUNDLE.md): one ONNX graph per stage the device runs, the
embedding tables, the tokenizer, the carried ONNX models, the voices and
manifest.json. Written to a scratch folder beside `out` and renamed into
place at the end, so a failed export leaves nothing half-written."""

from __future__ import annotations

import logging
import multiprocessing
import time
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from cosyedge_build.scratch_dir import check_new_dir, scratch_for

if TYPE_CHECKING:
    from cosyedge_build.export.graphs import StageGraph

log = logging.getLogger(__name__)


def export_bundle(model_dir: Path, out: Path, static_decode_len: int = 0,
                  static_flow_windows: tuple[int, ...] = (), static_flow_cache: int = 1024,
                  static_vocoder: bool = False, fused_decode_batches: tuple[int, ...] = (),
                  fused_decode_len: int = 0, batch_flow_sizes: tuple[int, ...] = (),
                  fused_decode_precision: str = "fp32", static_vocoder_first_hops: tuple[int, ...] = (),
                  batch_flow_precision: str = "fp32", batch_flow_attention: str = "plain",
                  fused_prefill_lengths: tuple[int, ...] = (), jobs: int = 1,
                  static_vocoder_hops: tuple[int, ...] = ()) -> Path:
    """`static_decode_len` > 0 adds the fixed-size decode step (CUDA graphs on ort-cuda) for that many
    positions; `static_flow_windows` the fixed-shape estimator graphs (flow_static.py) over a cache
    of `static_flow_cache` frames, and the streaming encoder's over the same windows
    (flow_encoder_static.py); `static_vocoder` the fixed-length vocoder graphs (hift_static.py);
    `fused_decode_batches` the onnxruntime-fused batched decode step (llm_fused.py) for those batch
    sizes over `fused_decode_len` positions (0: `static_decode_len`, else FUSED_DECODE_LEN), in
    `fused_decode_precision` (fp16: what onnxruntime's CUDA GroupQueryAttention runs), with one row's
    prefill graph of each of `fused_prefill_lengths` positions (captured on ort-cuda);
    `static_vocoder_first_hops` (with `static_vocoder`) a fixed-length vocoder graph for the first
    chunk of each of these first hops too, and `static_vocoder_hops` both chunks of each of these later
    hops (a schedule that grows its hop: `hop_scale`, `max_hop_tokens`; the steady chunk, and an offline
    request's first chunk);
    `batch_flow_sizes` (with `static_flow_windows`) the estimator windows batched across that many
    streams, K/V cache in place (flow_batch.py), in `batch_flow_precision` (fp16: the lanes' K/V in
    fp16 too), their attention `batch_flow_attention` (fused: onnxruntime's MultiHeadAttention), and the
    streaming encoder's windows batched across the same sizes (flow_encoder_batch.py), and with
    `static_vocoder` the fixed-length vocoder graphs too (hift_static.py). `jobs` 2 exports the flow and
    the vocoder in a second process beside the LLM (flow_side.py)."""
    from cosyedge_build.export.flow_batch import check_options

    check_options(batch_flow_precision, batch_flow_attention)
    if static_vocoder_first_hops and (not static_vocoder or min(static_vocoder_first_hops) < 1):
        raise ValueError("fixed-length vocoder graphs for first hops (--static-vocoder-first-hops) need "
                         f"--static-vocoder and hops >= 1 speech token, got {list(static_vocoder_first_hops)}")
    if static_vocoder_hops and (not static_vocoder or min(static_vocoder_hops) < 1):
        raise ValueError("fixed-length vocoder graphs for later hops (--static-vocoder-hops) need "
                         f"--static-vocoder and hops >= 1 speech token, got {list(static_vocoder_hops)}")
    if batch_flow_sizes and not static_flow_windows:
        raise ValueError("batched flow graphs (--batch-flow-sizes) need --static-flow-windows")
    if jobs not in (1, 2):
        raise ValueError(f"export jobs (--jobs) must be 1 or 2 (2: the flow and the vocoder beside the LLM), "
                         f"got {jobs}")
    import cosyedge_build.reference.modules as reference
    from cosyedge_build.export import bundle, hyperparams, llm, llm_fused, shared_weights, tokenizer, voices
    from cosyedge_build.export.flow_side import FlowSideOptions, export_flow_side, export_flow_side_from
    from cosyedge_build.export.shared_weights import SHARED_FUSED_FILE, SHARED_LLM_FILE
    from cosyedge_models.tools.progress import StageProgress

    model_dir, out = Path(model_dir), Path(out)
    check_new_dir(out, "bundle")
    started = time.monotonic()
    refs = reference.load_reference(model_dir)
    flow_opts = FlowSideOptions(static_flow_windows, static_flow_cache, static_vocoder, static_vocoder_first_hops,
                                batch_flow_sizes, batch_flow_precision, batch_flow_attention, static_vocoder_hops)
    with scratch_for(out) as scratch, ExitStack() as stack:
        hyper = hyperparams.collect(refs)
        flow_side: Future[tuple[list[StageGraph], dict[str, Path]]] | None = None
        if jobs == 2:  # spawn, not fork: the parent's torch threads and their locks do not carry over
            pool = stack.enter_context(ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")))
            flow_side = pool.submit(export_flow_side_from, model_dir, scratch, hyper, flow_opts)
        with StageProgress("export", 5 if flow_side else 7) as progress:
            stages, arrays = llm.export_llm(refs.llm, scratch, static_decode_len)
            progress.advance("LLM graphs")
            shared_weights.share_llm_stages(scratch, stages, SHARED_LLM_FILE)
            if fused_decode_batches:  # after the sharing pass: their fused weights are their own
                fused = llm_fused.export_fused_decode(
                    refs.llm, scratch, fused_decode_batches,
                    fused_decode_len or static_decode_len or llm_fused.FUSED_DECODE_LEN, fused_decode_precision,
                    fused_prefill_lengths)
                # one copy of them for every batch size and prefill length (on disk and on the device)
                shared_weights.share_stages(scratch, [s for s in fused if llm_fused.has_layer_weights(s.name)],
                                            SHARED_FUSED_FILE)
                stages.extend(fused)
            progress.advance("LLM weights shared")
            llm_count = len(stages)
            if flow_side is None:
                flow_stages, flow_arrays = export_flow_side(refs.flow, refs.hift, scratch, hyper, flow_opts,
                                                            progress.advance)
            stages.extend(bundle.carry_onnx(model_dir, scratch))
            tok = tokenizer.export_tokenizer(model_dir, scratch)
            voice_map = voices.export_voices(model_dir, scratch, hyper["mel_bins"], tok[0])
            progress.advance("tokenizer, carried models, voices")
            if flow_side is not None:
                flow_stages, flow_arrays = flow_side.result()
                progress.advance("flow and vocoder (beside)")
            stages[llm_count:llm_count] = flow_stages  # the LLM's, the flow's, the carried models' as before
            arrays.update(flow_arrays)
            bundle.write_manifest(
                scratch,
                model_dir=model_dir,
                hyper=hyper,
                stages=stages,
                arrays=arrays,
                tokenizer=tok,
                voices=voice_map,
            )
            progress.advance("manifest")
    log.info("exported %s to %s in %.1f s", model_dir, out, time.monotonic() - started)
    return out
