"""`cosyedge bench`: real-time factor, time to first audio, time per stage,
peak memory, throughput under concurrency, streaming vs offline cost on a
~20 s utterance, the per-chunk stage timeline of one streaming run, time to
first audio per first hop (--first-hop) and per first hop and first-chunk Euler steps with the mel
against the default (--first-chunk, models/tools/first_chunk_bench.py), other bundles of the same model on
the same backend (--compare: fp32 / fp16 / int8 side by side, with their
Jetson memory budget), and (with --reference) the official PyTorch pipeline
on the same checkpoint in the same run. --voice NAME runs all of it with a
saved zero-shot voice and adds `voice_cache` (models/tools/voice_bench.py). Writes
the keys the project tracks with --json; the timeline is also drawn as text
on stderr."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cosyedge_models.backends.fixed_shapes import OVERFLOW_FLOW_SLOTS
from cosyedge_models.batching.fused_step import FusedDecodeStep
from cosyedge_models.batching.graph_batcher import GraphBatcher
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.bundle.loader import Bundle, load_bundle
from cosyedge_models.bundle.memory_budget import BOARDS, MIB, bundle_budget
from cosyedge_models.errors import CosyEdgeError
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer
from cosyedge_models.tools.bench_runs import (
    concurrency_report,
    llm_tokens,
    run_concurrent_llm,
    run_once,
)
from cosyedge_models.tools.engine_memory import memory_delta, process_memory
from cosyedge_models.tools.first_chunk_bench import first_chunk_sweep, parse_combos
from cosyedge_models.tools.host import machine
from cosyedge_models.tools.precision_compare import accuracy
from cosyedge_models.tools.progress import StageProgress
from cosyedge_models.tools.timeline import render_level_traces, render_timeline
from cosyedge_models.tools.voice_bench import (
    check_voice,
    inline_first_audio_ms,
    llm_voice_report,
    voice_cache_report,
)

log = logging.getLogger(__name__)

# 20 text tokens with the real Qwen2 tokenizer: a random-weight model then
# speaks the maximum 20 x 20 = 400 speech tokens (16 s), as upstream measured.
DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog while the robot reads the news aloud."
# Words for the long utterance (streaming vs offline cost); as many are taken as
# give the wanted length (long_text).
LONG_TEXT = ("The kiosk greets every visitor, explains the opening hours, lists the exhibits on each floor, "
             "and answers questions about tickets, parking and the cafe")
LONG_SECONDS = 20.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def text_tokens(engine: CosyVoiceSynthesizer, text: str) -> int:
    return sum(len(seg.token_ids) for seg in engine.frontend.prepare(text))


def long_text(engine: CosyVoiceSynthesizer, seconds: float) -> tuple[str, float]:
    """A text from LONG_TEXT's words (repeated as needed) whose speech at the LLM's
    maximum length lasts about `seconds`, and that length. The maximum
    (max_token_text_ratio x text tokens, per segment) is what a random-weight
    checkpoint speaks; a trained one stops earlier: the measured seconds are
    reported with the result."""
    rate = float(engine.bundle.manifest.get("token_rate_hz", 25))
    ratio = engine.bundle.llm.max_token_text_ratio

    def expected_s(text: str) -> float:
        return sum(int(len(seg.token_ids) * ratio) for seg in engine.frontend.prepare(text)) / rate

    words = LONG_TEXT.split()
    text, length = "", 0.0
    for i in itertools.count():
        candidate = f"{text} {words[i % len(words)]}".strip()
        n = expected_s(candidate)
        if n >= seconds:
            # The closer of the two; never an empty text.
            return (candidate, n) if not text or n - seconds <= seconds - length else (text, length)
        text, length = candidate, n
    raise AssertionError("unreachable")


def long_utterance(engine: CosyVoiceSynthesizer, seconds: float, seed: int, tries: int = 3,
                   voice: str | None = None) -> tuple[
        str, float, dict[str, Any]]:
    """(text, its length at the LLM's maximum, the offline run) for an utterance
    of about `seconds`: starts from the maximum-length rule (exact for random
    weights) and lengthens the text while the model stops early (trained
    checkpoints, or a small random model that samples EOS soon after its minimum)."""
    target = seconds
    for attempt in range(tries):
        text, at_max = long_text(engine, target)
        run = run_once(engine, text, stream=False, seed=seed, voice=voice)
        if run["audio_s"] >= 0.8 * seconds or attempt == tries - 1:
            break
        target = at_max * seconds / max(run["audio_s"], 0.5)
    return text, at_max, run


def graph_bytes(bundle: Bundle) -> int:
    """Size of the stage graphs the bundle loads (external weight files included)."""
    total = 0
    for stage in bundle.stages.values():
        total += stage.path.stat().st_size
        data = stage.path.with_name(stage.path.name + ".data")
        total += data.stat().st_size if data.exists() else 0
    return total


def jetson_budget(bundle: Bundle) -> dict[str, Any]:
    """The bundle's memory budget (bundle/memory_budget.py) for its precision, compacted: totals and,
    per board, fits + spare."""
    try:
        budget = bundle_budget(bundle.root, bundle.manifest, bundle.precision)
    except (CosyEdgeError, KeyError, ValueError) as exc:
        return {"error": f"cannot compute the memory budget: {exc}"}
    boards = {}
    for board in BOARDS.values():
        fit = budget.fit(board)
        boards[board.key] = {"fits": fit["fits"], "spare_mb": round(fit["spare_bytes"] / MIB, 1)}
    return {"engines_mb": round(budget.engines_bytes / MIB, 1), "cpu_side_mb": round(budget.cpu_side_bytes / MIB, 1),
            "boards": boards}


def median_first_audio(runs: list[dict[str, Any]]) -> float | None:
    firsts = [r["first_audio_ms"] for r in runs if r["first_audio_ms"] is not None]
    return round(statistics.median(firsts), 1) if firsts else None


def first_hop_sweep(engine: CosyVoiceSynthesizer, text: str, hops: list[int], repeats: int,
                    voice: str | None = None) -> dict[str, float | None]:
    """Time to first audio per first hop. The engine reads its settings per
    request, so the hop is swapped on this engine (no reload) and restored."""
    original = engine.settings
    out: dict[str, float | None] = {}
    try:
        for hop in hops:
            engine.settings = dataclasses.replace(original, first_hop_tokens=hop)
            engine.warm_vocoder()  # as an engine loaded with that first hop (its first chunk's length)
            out[str(hop)] = median_first_audio([run_once(engine, text, stream=True, seed=r, voice=voice)
                                                for r in range(repeats)])
    finally:
        engine.settings = original
    return out


def compare_bundle(bundle_dir: str, settings: SynthesisSettings, text: str, repeats: int,
                   voice: str | None = None, reference: CosyVoiceSynthesizer | None = None) -> dict[str, Any]:
    """The same core measurements on another bundle (same backend and settings),
    its engine memory, and its output against `reference`'s (the bench's own
    engine): token agreement and mel SNR (models/tools/precision_compare.py)."""
    before = process_memory()
    # the bundle's own precision (not the faster-on-CUDA choice of an unset precision)
    own = load_bundle(bundle_dir).precision
    engine = load_synthesizer(bundle_dir, settings=dataclasses.replace(settings, precision=own))
    try:
        run_once(engine, text, stream=True, seed=0, voice=voice)  # warm-up (every weight touched)
        # measured in this process after the bundles before it:
        # `python -m cosyedge_models.tools.engine_memory` measures one alone
        memory = memory_delta(before, process_memory())
        acc = accuracy(reference, engine, text) if reference is not None else None
        offline = [run_once(engine, text, stream=False, seed=r, voice=voice) for r in range(repeats)]
        streaming = [run_once(engine, text, stream=True, seed=r, voice=voice) for r in range(repeats)]
        return {
            "bundle": str(Path(bundle_dir).resolve()),
            "precision": engine.bundle.precision,
            "graph_bytes": graph_bytes(engine.bundle),
            "session_memory_bytes": engine.session_memory_bytes(),
            "engine_memory": memory,
            "audio_s": round(statistics.median(r["audio_s"] for r in offline), 3),
            "rtf": round(statistics.median(r["rtf"] for r in offline), 4),
            "streaming_rtf": round(statistics.median(r["rtf"] for r in streaming), 4),
            "first_audio_ms": median_first_audio(streaming),
            "jetson_budget": jetson_budget(engine.bundle),
            "accuracy": acc,
        }
    finally:
        engine.close()


def static_flow_report(engine: CosyVoiceSynthesizer) -> dict[str, Any] | None:
    graphs = engine.static_flow
    if graphs is None:
        return None
    enc = engine.static_encoder
    encoder = None if enc is None else {"windows_tokens": enc.windows, "cache_tokens": enc.cache_tokens,
                                        "slots": enc.max_slots, "replays": enc.replays, "moves": enc.moves}
    return {"windows": graphs.windows, "cache_frames": graphs.cache_frames, "cuda_graphs": graphs.capture,
            "slots": graphs.max_slots, "replays": graphs.replays, "moves": graphs.moves, "encoder": encoder}


def int_list(value: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise CosyEdgeError(f"{what} takes comma-separated integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise CosyEdgeError(f"{what} takes integers >= 1, got {value!r}")
    return out


def project_command(args: argparse.Namespace) -> int:
    """`bench --project`: the Jetson projection from the bundle's graphs (no synthesis)."""
    from cosyedge_models.tools.graph_cost import RequestShape, bundle_workload
    from cosyedge_models.tools.launch_projection import H200_MEASURED as LAUNCH_H200_MEASURED
    from cosyedge_models.tools.launch_projection import launch_table
    from cosyedge_models.tools.projection import H200_MEASURED, format_projection, projection_table

    bundle = load_bundle(args.bundle, precision="fp32")
    shape = RequestShape(prompt_tokens=args.project_prompt_tokens or RequestShape.prompt_tokens)
    table = projection_table(bundle_workload(bundle.root, bundle.manifest, shape), H200_MEASURED)
    report = {"bench": "jetson_projection", "bundle": str(Path(args.bundle).resolve()), "machine": machine(),
              "request": dataclasses.asdict(shape), **table}
    # the same rows with the per-kernel launch cost calibrated on the H200 (docs/jetson-projection.md)
    report["launch"] = launch_table(table, LAUNCH_H200_MEASURED)
    print(format_projection(table))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


# The official pipeline's measurement (cosyedge_build.reference.pipeline.run_reference),
# handed in by the CLI: the runtime package never imports the build side.
ReferenceRunner = Callable[..., dict[str, Any]]


def save_partial(path: str | None, report: dict[str, Any]) -> None:
    """The report so far, marked incomplete, rewritten after each section: a run
    stopped at a time limit (a GPU lease) keeps what it measured."""
    if path:
        Path(path).write_text(json.dumps({**report, "complete": False}, indent=2) + "\n")


def bench_command(args: argparse.Namespace, reference: ReferenceRunner | None = None) -> int:
    if args.project:
        return project_command(args)
    text = args.text or DEFAULT_TEXT
    hops = int_list(args.first_hop, "--first-hop") if args.first_hop else []
    first_chunk = parse_combos(args.first_chunk) if args.first_chunk else []
    compare = [b for b in (args.compare or "").split(",") if b.strip()]
    concurrency = int_list(args.concurrency, "--concurrency") if args.concurrency else []
    batching = BatchSettings(max_batch_size=args.batching, max_queue_delay_ms=args.max_queue_delay_ms) \
        if args.batching else None
    flow_size = args.flow_batching
    flow_batching = (BatchSettings(max_batch_size=flow_size, max_queue_delay_ms=args.flow_queue_delay_ms)
                     if flow_size else None)
    mode = args.concurrency_mode
    overlap = False if args.serial else args.overlap
    voice: str | None = args.voice
    cache_mb = args.voice_cache_mb
    settings = SynthesisSettings(backend=args.backend, overlap_stages=overlap,
                              batching=batching, flow_batching=flow_batching,
                              flow_final_chunk=args.flow_final_chunk,
                              hop_scale=args.hop_scale, max_hop_tokens=args.max_hop_tokens,
                              first_hop_tokens=args.first_hop_tokens,
                              first_chunk_euler_steps=args.first_chunk_euler_steps,
                              # fixed-shape flow caches for every concurrent stream measured
                              graph_flow=args.graph_flow,
                              graph_encoder=args.graph_encoder,
                              graph_threads=args.graph_threads,
                              first_audio_first=args.first_audio_first,
                              # (with the batched windows the engine keeps two: the streams beyond the lanes)
                              graph_flow_slots=max(4, min(8, max(concurrency, default=1))),
                              graph_flow_overflow_slots=(OVERFLOW_FLOW_SLOTS if args.graph_flow_overflow_slots is None
                                                         else args.graph_flow_overflow_slots),
                              graph_flow_gather_ms=args.graph_flow_gather_ms,
                              # the iteration-level LLM batcher over the fixed-size decode, a slot per row
                              graph_batching=args.graph_batching,
                              graph_flow_batch=args.graph_flow_batch,
                              graph_encoder_batch=args.graph_encoder_batch,
                              graph_vocoder_batch=args.graph_vocoder_batch,
                              offline_as_stream=args.offline_as_stream,
                              vocoder_pad_final=args.vocoder_pad_final,
                              llm_prefills_between_steps=args.llm_prefills_between_steps,
                              llm_first_chunk_priority=args.llm_first_chunk_priority,
                              llm_parallel_prefills=args.llm_parallel_prefills,
                              llm_batched_prefill=args.llm_batched_prefill,
                              llm_captured_prefill=args.llm_captured_prefill,
                              graph_decode_slots=max(4, args.batching) if args.graph_batching else 4)
    if cache_mb is not None:
        settings = dataclasses.replace(settings, voice_cache_mb=cache_mb)
    t_load = time.perf_counter()
    try:
        engine = load_synthesizer(args.bundle, settings=settings)
    except ValueError as exc:  # settings this bundle cannot take (a first hop or Euler steps beyond its own)
        raise CosyEdgeError(str(exc)) from None
    load_ms = round((time.perf_counter() - t_load) * 1e3, 1)  # with every CUDA-graph capture
    # the iteration-level LLM batcher: asked for, and which batcher the engine runs (GraphBatcher or not)
    graph_batching = {"on": settings.graph_batching, "prefills_between_steps": settings.llm_prefills_between_steps,
                      "first_chunk_priority": settings.llm_first_chunk_priority,
                      "parallel_prefills": settings.llm_parallel_prefills,
                      "batched_prefill": isinstance(engine.batcher, GraphBatcher) and engine.batcher.batched_prefill,
                      "captured_prefill": isinstance(engine.batcher, GraphBatcher) and engine.batcher.captured_prefill,
                      "engine_batcher": type(engine.batcher).__name__ if engine.batcher else None,
                      # the step it drives: FusedDecodeStep (the bundle's fused graphs) or LoopedGraphStep
                      "step": type(engine.batcher.step).__name__ if isinstance(engine.batcher, GraphBatcher) else None}
    stack = contextlib.ExitStack()
    closed = False  # the engine, before the official pipeline
    try:
        if voice is not None:
            check_voice(engine, voice)
        if args.llm_only:
            llm_tokens(engine, text, seed=0, voice=voice)  # warm-up
            levels = [int(x) for x in args.concurrency.split(",") if x]
            report_llm = {"machine": machine(), "bundle": str(Path(args.bundle).resolve()),
                          "backend": engine.backend.describe(),
                          "batching": None if batching is None else vars(batching), "voice": voice,
                          "concurrency": {str(n): run_concurrent_llm(engine, text, n, voice) for n in levels}}
            if voice is not None:  # the LLM prefix off and on (models/tools/voice_bench.py)
                report_llm["voice_cache"] = llm_voice_report(engine, text, voice, max(args.repeats, 3))
            print(json.dumps(report_llm, indent=2))
            if args.json:
                Path(args.json).write_text(json.dumps(report_llm, indent=2) + "\n")
            return 0
        run_once(engine, text, stream=True, seed=0, voice=voice)  # warm-up: session arenas, page-in of weights
        if not args.concurrency_only:
            # a bar on a terminal, one line per part otherwise: a full-size run takes many minutes
            steps = 3 + sum(map(bool, (hops, first_chunk, voice, concurrency, compare, args.reference)))
            progress = stack.enter_context(StageProgress("bench", steps))
            progress.advance("warm-up")
        if args.concurrency_only:
            run_once(engine, text, stream=False, seed=0, voice=voice)  # the offline shapes too
            report_c = {"machine": machine(engine.backend.name), "bundle": str(Path(args.bundle).resolve()),
                        "precision": engine.bundle.precision, "backend": engine.backend.describe(),
                        "batching": None if batching is None else vars(batching),
                        "flow_batching": None if flow_batching is None else vars(flow_batching),
                        "overlap_stages": engine.overlap, "offline_as_stream": engine.offline_as_stream,
                        "vocoder_pad_final": engine.vocoder.pad_final,
                        "fixed_size_decode": engine.lm.fixed_size_decode is not None, "text": text,
                        "load_ms": load_ms, "graph_load_s": engine.graphs.load_seconds, "voice": voice,
                        "graph_device_used_bytes": engine.graphs.device_used_bytes,
                        "first_audio_first": settings.first_audio_first, "graph_batching": graph_batching,
                        "python_switch_interval_ms": round(sys.getswitchinterval() * 1e3, 3),
                        "first_hop_tokens": settings.first_hop_tokens,
                        "hop_scale": settings.hop_scale, "max_hop_tokens": settings.max_hop_tokens,
                        "first_chunk_euler_steps": settings.first_chunk_euler_steps,
                        **concurrency_report(engine, text, concurrency, mode, voice, args.graph_trace_ms),
                        "graph_order": engine.graphs.order_stats(),
                        "graph_flow_batch": engine.graphs.flow_batch_stats(),
                        "graph_encoder_batch": engine.graphs.encoder_batch_stats(),
                        "graph_vocoder_batch": engine.graphs.vocoder_batch_stats()}
            print(render_level_traces(report_c.get("concurrency", {})), file=sys.stderr)
            print(render_level_traces(report_c.get("concurrency_offline", {}), offline=True), file=sys.stderr)
            print(json.dumps(report_c, indent=2))
            if args.json:
                Path(args.json).write_text(json.dumps(report_c, indent=2) + "\n")
            return 0
        log.info("warm-up done; offline and streaming runs")
        offline = [run_once(engine, text, stream=False, seed=r, voice=voice) for r in range(args.repeats)]
        streaming = [run_once(engine, text, stream=True, seed=r, voice=voice) for r in range(args.repeats)]
        progress.advance("offline and streaming runs")
        shown = streaming[0]
        report: dict[str, Any] = {
            "machine": machine(engine.backend.name),
            "bundle": str(Path(args.bundle).resolve()),
            "precision": engine.bundle.precision,
            "backend": engine.backend.describe(),
            "batching": None if batching is None else vars(batching),
            "flow_batching": None if flow_batching is None else vars(flow_batching),
            "overlap_stages": engine.overlap,
            "fixed_size_decode": engine.lm.fixed_size_decode is not None,  # the CUDA-graph LLM step
            "static_flow": static_flow_report(engine),  # the fixed-shape (CUDA-graph) flow estimator
            "load_ms": load_ms,  # the engine's load, CUDA-graph captures included
            "graph_load_s": engine.graphs.load_seconds,  # of which each CUDA-graph stage
            "graph_device_used_bytes": engine.graphs.device_used_bytes,  # the GPU in use after each stage
            "text": text,
            "voice": voice,
            "audio_s": round(statistics.median(r["audio_s"] for r in offline), 3),
            "rtf": round(statistics.median(r["rtf"] for r in offline), 4),
            "streaming_rtf": round(statistics.median(r["rtf"] for r in streaming), 4),
            "first_audio_ms": median_first_audio(streaming),
            "stages_ms": {k: round(statistics.median(float(r["stages_ms"][k] or 0) for r in offline), 1)
                          for k in ("frontend_ms", "llm_ms", "flow_ms", "vocoder_ms")},
            # One streaming run's per-chunk stage events (ms since the request started).
            "timeline": {"seed": 0, "first_audio_ms": round(shown["first_audio_ms"] or 0.0, 1),
                         "total_ms": round(shown["total_s"] * 1e3, 1),
                         "events": [e.as_dict() for e in sorted(shown["timeline"], key=lambda e: e.start_ms)]},
        }
        log.info("rtf %.4f, first audio %.1f ms; streaming cost on a long text", report["rtf"],
                 report["first_audio_ms"])
        save_partial(args.json, report)
        long_seconds = args.long_seconds or LONG_SECONDS
        long, at_max_s, long_off = long_utterance(engine, long_seconds, seed=7, voice=voice)
        long_str = run_once(engine, long, stream=True, seed=7, voice=voice)
        flow_off, flow_str = long_off["stages_ms"], long_str["stages_ms"]
        report["streaming_cost_vs_offline"] = {
            "audio_s": round(long_off["audio_s"], 2),  # the utterance's measured length
            "target_s": long_seconds,
            "max_length_s": round(at_max_s, 2),  # at the LLM's maximum length (random weights speak exactly this)
            "text_tokens": text_tokens(engine, long),
            "speech_tokens": int(long_off["stages_ms"].get("llm_tokens", 0)),
            "offline_s": round(long_off["total_s"], 3),
            "streaming_s": round(long_str["total_s"], 3),
            "ratio": round(long_str["total_s"] / long_off["total_s"], 3),
            # the flow alone (where streaming's extra work was): wall time and estimator frames
            "flow_ms_ratio": round(float(flow_str["flow_ms"] or 0) / max(float(flow_off["flow_ms"] or 0), 1e-9), 3),
            "flow_frames_ratio": round(float(flow_str.get("flow_frames") or 0)
                                       / max(float(flow_off.get("flow_frames") or 0), 1.0), 3),
            "flow_final_chunk": settings.flow_final_chunk,
        }
        log.info("streaming cost %s", report["streaming_cost_vs_offline"])
        progress.advance("streaming cost on a long utterance")
        save_partial(args.json, report)
        if hops:
            report["first_hop"] = first_hop_sweep(engine, text, hops, args.repeats, voice)
            progress.advance("first hops")
        if first_chunk:
            report["first_chunk"] = first_chunk_sweep(engine, text, first_chunk, args.repeats, voice)
            progress.advance("first-chunk settings")
            save_partial(args.json, report)
        if voice is not None:
            report["voice_cache"] = voice_cache_report(engine, text, voice, args.repeats, run_once)
            if args.voice_wav:
                report["voice_cache"].update(inline_first_audio_ms(engine, text, voice, Path(args.voice_wav),
                                                                   args.repeats))
            progress.advance("voice cache off and on")
            save_partial(args.json, report)
        report.update(concurrency_report(engine, text, concurrency, mode, voice, args.graph_trace_ms))
        if concurrency:
            progress.advance("concurrency")
        # what the graph thread's order did over the runs so far (first-audio holds, LLM steps held)
        report["first_audio_first"] = settings.first_audio_first
        report["python_switch_interval_ms"] = round(sys.getswitchinterval() * 1e3, 3)  # the entry point's
        report["first_hop_tokens"] = settings.first_hop_tokens  # None: upstream's aligned hop
        report["hop_scale"], report["max_hop_tokens"] = settings.hop_scale, settings.max_hop_tokens  # None: 4 x hop
        report["first_chunk_euler_steps"] = settings.first_chunk_euler_steps  # None: the bundle's
        report["offline_as_stream"] = engine.offline_as_stream
        report["vocoder_pad_final"] = engine.vocoder.pad_final
        if isinstance(engine.batcher, GraphBatcher) and isinstance(engine.batcher.step, FusedDecodeStep):
            # captured prefills whose voice prefix the scratch row still held (no upload, no insert run)
            graph_batching["prefix_reuses"] = engine.batcher.step.prefix_reuses
        report["graph_batching"] = graph_batching
        report["graph_order"] = engine.graphs.order_stats()
        report["graph_flow_batch"] = engine.graphs.flow_batch_stats()  # None: off
        report["graph_encoder_batch"] = engine.graphs.encoder_batch_stats()  # None: off
        report["graph_vocoder_batch"] = engine.graphs.vocoder_batch_stats()  # None: off
        report["session_memory_bytes"] = engine.session_memory_bytes()
        report["peak_rss_mb"] = round(peak_rss_mb(), 1)  # before other bundles load and the reference loads torch
        save_partial(args.json, report)
        if compare:
            report["compare"] = [compare_bundle(b.strip(), settings, text, args.repeats, voice, engine)
                                 for b in compare]
            progress.advance("other bundles")
            save_partial(args.json, report)
        if args.reference:
            if reference is None:
                raise CosyEdgeError("--reference needs the official pipeline: run it through `cosyedge bench`")
            log.info("the official pipeline")
            # the engine's GPU memory goes back first (it needs only the bundle and the tokenizer): beside a
            # goals' engine (58.6 GB) the official pipeline did not fit an 80 GB card (twenty-third run)
            closed = True
            engine.close()
            ref = reference(engine.bundle, engine.tokenizer, text, repeats=args.repeats, voice=voice)
            report["reference"] = ref
            report["speedup_vs_reference"] = round(ref["rtf"] / report["rtf"], 3)
            report["first_audio_vs_reference"] = round(report["first_audio_ms"] / ref["first_audio_ms"], 3)
            progress.advance("official pipeline")
    finally:
        stack.close()
        if not closed:
            engine.close()
    print(render_timeline(shown["timeline"]), file=sys.stderr)
    print(render_level_traces(report.get("concurrency", {})), file=sys.stderr)
    print(render_level_traces(report.get("concurrency_offline", {}), offline=True), file=sys.stderr)
    report["complete"] = True
    text_out = json.dumps(report, indent=2)
    print(text_out)
    if args.json:
        Path(args.json).write_text(text_out + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
