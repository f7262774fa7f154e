"""One bench measurement at a time: a request run once (time to first audio,
RTF, stage times, its timeline), and n of them at once (throughput, first-audio
percentiles, the slowest stream's RTF; the LLM alone with --llm-only). Used by
`cosyedge bench` (models/tools/bench.py) and models/tools/arena_speed.py."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from cosyedge_models.backends.profiling import GraphTrace
from cosyedge_models.batching.llm_batcher import BatchStats
from cosyedge_models.synthesis.api import StageEvent, SynthesisRequest
from cosyedge_models.synthesis.llm import LlmInput
from cosyedge_models.synthesis.sampling import TokenSampler
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer
from cosyedge_models.tools.thread_cpu import ThreadCpu, level_cpu

log = logging.getLogger(__name__)


def bench_request(text: str, stream: bool, seed: int, voice: str | None = None) -> SynthesisRequest:
    """The default voice in sft mode, or a saved voice in zero_shot mode (--voice)."""
    if voice is None:
        return SynthesisRequest(text=text, stream=stream, seed=seed)
    return SynthesisRequest(text=text, stream=stream, seed=seed, voice=voice, mode="zero_shot")


def run_once(engine: CosyVoiceSynthesizer, text: str, stream: bool, seed: int,
             voice: str | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = None
    samples = 0
    last = None
    for chunk in engine.synthesize(bench_request(text, stream, seed, voice)):
        if first is None and chunk.pcm.size:
            first = (time.perf_counter() - t0) * 1e3
        samples += chunk.pcm.size
        last = chunk
    total = time.perf_counter() - t0
    audio_s = samples / engine.sample_rate
    times = last.times.as_dict() if last is not None else {}
    timeline: list[StageEvent] = list(last.times.timeline) if last is not None else []
    return {"total_s": total, "audio_s": audio_s, "rtf": total / audio_s if audio_s else float("nan"),
            "first_audio_ms": first, "stages_ms": times, "timeline": timeline,
            "first_token_ms": last.times.first_token_ms if last is not None else None}


def run_parallel(n: int, worker: Callable[[int], None]) -> float:
    """Run worker(0..n-1) on n threads at once; the wall seconds until all ended."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,), name=f"bench-request-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def llm_delta(before: BatchStats | None, after: BatchStats) -> dict[str, float]:
    """The LLM batcher's steps over a level (and those that served several streams); for the graph
    batcher, the ms of its rounds' prefills and of its steps' graph-thread calls and host work."""
    old = before or BatchStats()
    out: dict[str, float] = {"llm_steps": after.steps - old.steps,
                             "llm_shared_steps": after.shared_steps - old.shared_steps}
    if after.batched_prefills > old.batched_prefills:  # prefill runs that served several streams
        out["llm_batched_prefills"] = after.batched_prefills - old.batched_prefills
    if after.captured_prefills > old.captured_prefills:  # prompts through the captured prefill graphs
        out["llm_captured_prefills"] = after.captured_prefills - old.captured_prefills
    if after.handed_tokens > old.handed_tokens:  # the streams' wake-ups that took their tokens to them
        out["llm_handed_tokens"] = after.handed_tokens - old.handed_tokens
        out["llm_handovers"] = after.handovers - old.handovers
    spent = {"llm_prefill_ms": after.prefill_s - old.prefill_s, "llm_step_call_ms": after.step_call_s - old.step_call_s,
             "llm_step_host_ms": after.step_host_s - old.step_host_s}
    out.update({name: round(s * 1e3, 1) for name, s in spent.items() if s > 0})  # the graph batcher's
    return out


# the GPU graph threads' order counters (GraphThread.order_stats) reported per level, by their key there
ORDER_KEYS = {"holds": "graph_holds", "deferred": "graph_llm_held", "held_ms": "graph_held_ms",
              "forced": "graph_forced", "expired": "graph_expired", "released": "graph_llm_released"}


def order_delta(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the graph threads' order did between two GraphStages.order_stats(), summed over the
    threads: first-audio holds opened, LLM steps they held, ms with a hold open, bound hits; and
    `graph_busy_ms`, the ms the threads ran work, by the work's label (where the GPU time went), and
    `graph_waited_ms`, the ms that work waited in the threads' queues before it ran, by label."""
    out: dict[str, Any] = {}
    for thread, stats in after.items():
        old = before.get(thread, {})
        for key, name in ORDER_KEYS.items():
            out[name] = round(out.get(name, 0.0) + float(stats[key]) - float(old.get(key, 0)), 1)
    for key, name in (("busy_ms", "graph_busy_ms"), ("waited_ms", "graph_waited_ms")):
        by_label: dict[str, float] = {}
        for thread, stats in after.items():
            old_ms = before.get(thread, {}).get(key, {})
            for label, ms in stats.get(key, {}).items():
                by_label[label] = by_label.get(label, 0.0) + float(ms) - float(old_ms.get(label, 0.0))
        if by_label:
            out[name] = {label: round(ms, 1) for label, ms in sorted(by_label.items()) if ms > 0}
    return out


def flow_batch_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the batched estimator windows did between two FlowBatchStats.as_dict() (None: off):
    replays, rows, shared replays, replays by streams served and their mean ms, partner waits, the lanes'
    seeds (`fresh`: found as a refresh left them, nothing written; `refreshes` and `zeroings` at streams' ends,
    lanes.py),
    replays by window (and those that mixed windows) and single-stream replays by what else waited."""
    if after is None:
        return None
    old = before or {}
    # the lanes' refreshes, the engine's seats and its later chunks' gather (graph_flow_gather_ms), where it has them
    extra = tuple(key for key in ("fresh", "refreshes", "zeroings", "refreshes_dropped", "seat_waits", "seat_wait_ms",
                                  "unseated", "gather_holds", "gather_held_ms", "gather_rounds", "gather_full_rounds")
                  if key in after)
    out: dict[str, Any] = {key: round(float(after[key]) - float(old.get(key, 0)), 1)
                           for key in ("replays", "rows", "shared_replays", "fallbacks", "moves", "partner_wait_ms",
                                       "seeds", "reuses", "mixed_windows", *extra)}
    sizes = {n: int(c) - int(old.get("batch_sizes", {}).get(n, 0)) for n, c in after["batch_sizes"].items()}
    spent = {n: float(ms) - float(old.get("replay_ms", {}).get(n, 0.0)) for n, ms in after["replay_ms"].items()}
    out["batch_sizes"] = {n: c for n, c in sorted(sizes.items()) if c > 0}
    out["replay_ms_mean"] = {n: round(spent[n] / c, 2) for n, c in sorted(sizes.items()) if c > 0 and n in spent}
    for name in ("windows", "singles"):  # replays by window, single-stream replays by what else waited
        counts = {k: int(c) - int(old.get(name, {}).get(k, 0)) for k, c in after.get(name, {}).items()}
        out[name] = {k: c for k, c in sorted(counts.items()) if c > 0}
    return out


def encoder_batch_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    """What the batched encoder windows did between two EncoderBatchStats.as_dict() (None: off): replays,
    rows they served, replays shared by streams, voice seeds that found their lane fresh and lanes
    refreshed; the most streams in one replay so far."""
    if after is None:
        return None
    old = before or {}
    return {**{k: after[k] - old.get(k, 0) for k in ("replays", "rows", "shared_replays", "fresh", "refreshes")},
            "peak_batch": after["peak_batch"]}


# the first chunk's milestones of a stream, ms after its request started (StageEvent of chunk 0)
# (stage, its end (True) or start, name); first_token_ms (StageTimes) sits between llm_start and llm_end
FIRST_CHUNK_MARKS = (("llm", False, "llm_start_ms"), ("llm", True, "llm_end_ms"), ("flow", False, "flow_start_ms"),
                     ("flow", True, "flow_end_ms"), ("vocoder", True, "vocoder_end_ms"))


def first_chunk_marks(events: list[StageEvent], first_token_ms: float | None = None) -> dict[str, float]:
    """One stream's first-chunk milestones: its LLM started (after the frontend and its voice's setup),
    its first token sampled (the prefill and a step done), its tokens, its flow's start and end, its vocoder."""
    out: dict[str, float] = {}
    for stage, end, name in FIRST_CHUNK_MARKS:
        mine = [e for e in events if e.chunk == 0 and e.stage == stage]
        if mine:
            out[name] = round(max(e.end_ms for e in mine) if end else min(e.start_ms for e in mine), 1)
    if first_token_ms is not None:
        out["first_token_ms"] = round(first_token_ms, 1)
    return out


def first_chunk_profile(timelines: list[list[StageEvent]],
                        first_tokens: list[float | None] | None = None) -> dict[str, dict[str, float]]:
    """Per milestone of the first chunk (first_chunk_marks), the p50 and max over the streams of a level:
    where their first audio waited; `slowest`: the marks of the stream whose first chunk ended last (a
    level's p95 is often one stream, and its marks say whether it started late, prefilled late or
    waited for its flow)."""
    tokens = first_tokens if first_tokens is not None else [None] * len(timelines)
    streams = [first_chunk_marks(events, t) for events, t in zip(timelines, tokens, strict=True)]
    out: dict[str, dict[str, float]] = {}
    for name in [m[2] for m in FIRST_CHUNK_MARKS] + ["first_token_ms"]:
        values = [s[name] for s in streams if name in s]
        if values:
            out[name] = {"p50": round(float(np.percentile(values, 50)), 1), "max": round(max(values), 1)}
    ended = [s for s in streams if "vocoder_end_ms" in s]
    if len(ended) > 1:
        out["slowest"] = max(ended, key=lambda s: s["vocoder_end_ms"])
    return out


def run_concurrent(engine: CosyVoiceSynthesizer, text: str, n: int, stream: bool = True,
                   voice: str | None = None, requests: int | None = None, trace_ms: float = 0.0) -> dict[str, Any]:
    """`requests` (default n) requests, n at a time (request i has seed 1000 + i): completed requests/s,
    first-audio percentiles, the slowest stream's RTF, the batchers' mean batch, the graph threads' order
    counters; `failed` (and the first `errors`): requests that raised, left out of the figures. `trace_ms`
    > 0 with graph threads: `graph_trace`, the items they ran that started in the level's first trace_ms
    (GraphTrace.as_dict; times since the level started)."""
    total = n if requests is None else requests
    if total < n:
        raise ValueError(f"{total} requests cannot keep {n} at a time")
    runs: list[dict[str, Any]] = [{} for _ in range(total)]
    errors: list[str] = []
    engine.graphs.settle()  # the requests before left nothing queued (their lanes' end-of-stream writes)
    before = {b.name: (b.stats.runs, b.stats.calls) for b in engine.stage_batchers}
    llm_before = dataclasses.replace(engine.batcher.stats) if engine.batcher else None
    order_before = engine.graphs.order_stats()
    flow_before = engine.graphs.flow_batch_stats()
    encoder_before = engine.graphs.encoder_batch_stats()
    cpu_before = ThreadCpu()
    trace = GraphTrace(time.perf_counter(), trace_ms / 1e3) if trace_ms > 0 and engine.graphs.threads else None
    engine.graphs.record_trace(trace)

    def worker(k: int) -> None:
        for i in range(k, total, n):  # thread k: requests k, k + n, ...; one at a time where n is 1
            try:
                runs[i] = run_once(engine, text, stream=stream, seed=1000 + i, voice=voice)
            except Exception as exc:  # a failed request is a figure of the level, not the end of the bench
                log.error("bench request %d of %d failed: %s", i + 1, total, exc, exc_info=True)
                errors.append(f"{type(exc).__name__}: {exc}")

    try:
        wall = run_parallel(n, worker)
        engine.graphs.settle()  # the level's own end-of-stream writes, in its figures
    finally:
        engine.graphs.record_trace(None)
    cpu = level_cpu(cpu_before, ThreadCpu(), wall)  # which threads spent the level's CPU (thread_cpu.py)
    results = [r for r in runs if r]  # the requests that completed
    firsts = [r["first_audio_ms"] for r in results if r.get("first_audio_ms") is not None]
    tokens = sum(int(r["stages_ms"].get("llm_tokens", 0)) for r in results)
    audio = sum(r["audio_s"] for r in results)
    out: dict[str, Any] = {
        "requests": total,
        "requests_per_s": round(len(results) / wall, 4),  # completed requests
        "tokens_per_s": round(tokens / wall, 2),
        "first_audio_ms_p50": round(float(np.percentile(firsts, 50)), 1) if firsts else float("nan"),
        "first_audio_ms_p95": round(float(np.percentile(firsts, 95)), 1) if firsts else float("nan"),
        "rtf": round(wall / audio, 4) if audio else float("nan"),  # all streams' wall over all their audio
        # the slowest stream's own RTF: above 1, some listener heard gaps
        "stream_rtf_max": round(max(float(r["rtf"]) for r in results), 4) if results else float("nan"),
        "failed": len(errors),
    }
    if errors:
        out["errors"] = sorted(set(errors))[:5]
    for b in engine.stage_batchers:
        # requests per graph run at this level (1.0: nothing merged)
        graph_runs, calls = b.stats.runs - before[b.name][0], b.stats.calls - before[b.name][1]
        out[f"{b.name}_mean_batch"] = round(calls / graph_runs, 3) if graph_runs else 0.0
    if engine.batcher is not None:  # LLM decode steps at this level and those that served several streams
        out.update(llm_delta(llm_before, engine.batcher.stats))
    out.update(order_delta(order_before, engine.graphs.order_stats()))  # (no graph thread: nothing)
    flow = flow_batch_delta(flow_before, engine.graphs.flow_batch_stats())
    if flow is not None:
        out["graph_flow_batch"] = flow
    encoder = encoder_batch_delta(encoder_before, engine.graphs.encoder_batch_stats())
    if encoder is not None:
        out["graph_encoder_batch"] = encoder
    out.update(cpu)
    if trace is not None:
        out["graph_trace"] = trace.as_dict()
    if stream:
        out["first_chunk_ms"] = first_chunk_profile([r["timeline"] for r in results],
                                                    [r["first_token_ms"] for r in results])
    return out


def concurrency_report(engine: CosyVoiceSynthesizer, text: str, levels: list[int], mode: str,
                       voice: str | None = None, trace_ms: float = 0.0) -> dict[str, Any]:
    """`concurrency` (streaming requests) and/or `concurrency_offline`, per level. Level n serves n
    requests at once, and level 1 the largest level's requests one after another (the same seeds): a
    level's requests/s and aggregate RTF then compare with one at a time on the same utterances, whose
    lengths vary with the seed (68-116 tokens for one seed across GPU processes, twenty-fifth run), and
    level 1's percentiles are over all of them. With a saved voice, the voice is prepared first, as the
    daemon prepares its default voice at start (`voice_lanes_seeded`: the batched estimator lanes that
    then hold its flow prefix). `trace_ms`: each level's graph-thread trace (run_concurrent), streamed
    and offline (where the offline RTF goes)."""
    out: dict[str, Any] = {}
    if voice is not None:
        out["voice_lanes_seeded"] = engine.prepare_voice(voice)
    largest = max(levels, default=1)
    modes = [("concurrency", True)] if mode in ("stream", "both") else []
    modes += [("concurrency_offline", False)] if mode in ("offline", "both") else []
    for key, stream in modes:
        out[key] = {str(n): run_concurrent(engine, text, n, stream=stream, voice=voice,
                                           requests=largest if n == 1 else n, trace_ms=trace_ms)
                    for n in levels}
    return out


def llm_tokens(engine: CosyVoiceSynthesizer, text: str, seed: int, voice: str | None = None) -> int:
    """Speech tokens of the text's segments, through the batcher when the engine has one."""
    config = engine.bundle.llm
    sampler = TokenSampler.seeded(config.sampling, config.eos_token, seed)
    request = bench_request(text, False, seed, voice)
    cond = engine.conditioning.build(request)
    prefix = engine.llm_prefix(cond, request.mode)  # as the engine would: a saved voice's LLM prefix
    n = 0
    for segment in engine.frontend.prepare(text):
        inp = LlmInput(text=segment.token_ids.tolist(), prompt_text=cond.prompt_text, prompt_speech=cond.prompt_speech,
                       prefix=prefix)
        gen = engine.batcher.generate(inp, sampler) if engine.batcher else engine.lm.generate(inp, sampler)
        n += sum(1 for _ in gen)
    return n


def run_concurrent_llm(engine: CosyVoiceSynthesizer, text: str, n: int, voice: str | None = None) -> dict[str, float]:
    """`n` requests' speech tokens at once; with a batcher, its steps over the level (llm_delta: for the
    graph batcher the ms of its steps' calls and host work too)."""
    counts = [0] * n
    before = dataclasses.replace(engine.batcher.stats) if engine.batcher is not None else None

    def worker(i: int) -> None:
        counts[i] = llm_tokens(engine, text, seed=1000 + i, voice=voice)

    wall = run_parallel(n, worker)
    out: dict[str, float] = {"tokens": sum(counts), "tokens_per_s": round(sum(counts) / wall, 2),
                             "requests_per_s": round(n / wall, 4)}
    if engine.batcher is not None:
        out.update(llm_delta(before, engine.batcher.stats))
    return out
