"""`cosyedge bench` on the tiny bundle: the tracked JSON keys, the timeline,
--first-hop and --compare against an fp16 variant. Structure and sane values
only; speeds are not asserted (2 shared CPU cores)."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from cosyedge_daemon.cli.main import main
from cosyedge_models.batching.turns import EMPTY_TURN
from cosyedge_models.bundle.memory_budget import BOARDS
from cosyedge_models.synthesis.api import StageEvent
from cosyedge_models.synthesis.synthesizer import resolve_overlap
from cosyedge_models.tools.timeline import render_timeline

from tests.support.module_tmp import ModuleTmp


@pytest.fixture(scope="module")
def fp16_variant(tiny_bundle: Path, module_tmp: ModuleTmp) -> Path:
    """The cheapest quantized variant: fp16 with the fewest calibration feeds."""
    from cosyedge_build.quantize.pipeline import quantize_bundle
    from cosyedge_build.quantize.settings import AccuracyBudget, QuantizeSettings

    out = module_tmp.mktemp("bench") / "b16"
    quantize_bundle(tiny_bundle, out, QuantizeSettings(precision="fp16", calibration_size=1, held_out_size=1,
                                                       feeds_per_stage=2, budget=AccuracyBudget(e2e_match_min=0.0)))
    return out


def test_bench_json_with_first_hop_and_compare(tiny_bundle: Path, fp16_variant: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--bundle", str(tiny_bundle), "--repeats", "1", "--concurrency", "1",
                 "--first-hop", "5,12", "--long-seconds", "2", "--compare", f"{tiny_bundle},{fp16_variant}",
                 "--json", str(out)]) == 0
    captured = capsys.readouterr()
    r: dict[str, Any] = json.loads(out.read_text())
    assert json.loads(captured.out) == r
    # not a terminal: one progress line per part, with the step count and an estimate of the time left
    progress = [line for line in captured.err.splitlines() if " bench: " in line]
    assert [line.split(" bench: ")[1].split(" done")[0] for line in progress] == [
        "warm-up", "offline and streaming runs", "streaming cost on a long utterance", "first hops",
        "concurrency", "other bundles"]
    assert "(6/6)" in progress[-1] and "ETA" in progress[0]

    for key in ("machine", "bundle", "rtf", "first_audio_ms", "stages_ms", "peak_rss_mb", "concurrency",
                "streaming_cost_vs_offline", "timeline", "first_hop", "compare"):
        assert key in r, key
    assert r["rtf"] > 0 and r["first_audio_ms"] > 0 and r["complete"] is True
    assert r["overlap_stages"] is resolve_overlap(None, "ort", os.cpu_count())
    assert r["fixed_size_decode"] is False  # the tiny bundle has no fixed-size step
    assert set(r["concurrency"]["1"]) == {"requests", "requests_per_s", "tokens_per_s", "first_audio_ms_p50",
                                          "first_audio_ms_p95", "rtf", "stream_rtf_max", "failed", "first_chunk_ms",
                                          "process_cpu_ms", "cores_busy", "thread_cpu_ms",
                                          "host_cores_busy", "host_iowait_cores"}
    # the level's CPU by thread: the request's own thread ended before the snapshot
    level = r["concurrency"]["1"]
    assert level["process_cpu_ms"] > 0 and level["thread_cpu_ms"]["ended or unnamed"] > 0
    # the one stream's first chunk: its tokens, then its flow, then its vocoder
    marks = r["concurrency"]["1"]["first_chunk_ms"]
    assert 0 < marks["llm_start_ms"]["p50"] < marks["first_token_ms"]["p50"] <= marks["llm_end_ms"]["p50"]
    assert marks["llm_end_ms"]["p50"] <= marks["flow_start_ms"]["p50"] < marks["flow_end_ms"]["p50"]
    assert marks["flow_end_ms"]["p50"] <= marks["vocoder_end_ms"]["p50"] == marks["vocoder_end_ms"]["max"]
    assert r["concurrency"]["1"]["failed"] == 0
    assert r["concurrency"]["1"]["stream_rtf_max"] > 0
    cost = r["streaming_cost_vs_offline"]
    assert cost["target_s"] == 2 and cost["audio_s"] > 0 and cost["ratio"] > 0 and cost["max_length_s"] > 0

    events = r["timeline"]["events"]
    assert {e["stage"] for e in events} == {"llm", "flow", "vocoder"}
    assert all(0 <= e["start_ms"] <= e["end_ms"] <= r["timeline"]["total_ms"] for e in events)
    assert "llm     |" in captured.err and "vocoder |" in captured.err  # the text rendering

    assert set(r["first_hop"]) == {"5", "12"} and all(v > 0 for v in r["first_hop"].values())

    fp32, fp16 = r["compare"]
    assert (fp32["precision"], fp16["precision"]) == ("fp32", "fp16")
    for entry in (fp32, fp16):
        assert entry["graph_bytes"] > 0 and entry["session_memory_bytes"] > 0
        assert entry["rtf"] > 0 and entry["first_audio_ms"] > 0 and entry["audio_s"] > 0
        budget = entry["jetson_budget"]
        assert set(budget["boards"]) == set(BOARDS) and budget["engines_mb"] > 0
        assert all(isinstance(b["fits"], bool) for b in budget["boards"].values())
    assert fp16["graph_bytes"] < fp32["graph_bytes"]
    assert fp16["jetson_budget"]["engines_mb"] < fp32["jetson_budget"]["engines_mb"]
    # against the bench's own engine (the fp32 tiny bundle): itself exactly, fp16 close and finite
    assert fp32["accuracy"]["token_agreement"] == 1.0 and fp32["accuracy"]["mel_snr_db"] == float("inf")
    assert fp16["accuracy"]["mel_nonfinite"] == 0 and fp16["accuracy"]["mel_snr_db"] > 15
    assert 0 <= fp16["accuracy"]["token_agreement"] <= 1


def test_bench_concurrency_only_offline_and_streaming_with_flow_batching(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    assert main(["bench", "--bundle", str(tiny_bundle), "--concurrency", "1,2", "--concurrency-mode", "both",
                 "--concurrency-only", "--flow-batching", "2", "--flow-queue-delay-ms", "1", "--json",
                 str(out), "--graph-batching", "--llm-prefills-between-steps", "2", "--graph-flow-batch",
                 "--llm-first-chunk-priority", "first_audio", "--llm-parallel-prefills", "2",
                 "--llm-batched-prefill"]) == 0
    r: dict[str, Any] = json.loads(out.read_text())
    assert r["graph_flow_batch"] is None  # asked for, but no fixed-shape flow windows here (flow batching)
    # asked for, but without --batching (and a fixed-size decode step in the bundle) no LLM batcher runs,
    # so no prefill is batched either (batched_prefill: whether the batcher runs them so)
    assert r["graph_batching"] == {"on": True, "prefills_between_steps": 2, "first_chunk_priority": "first_audio",
                                   "parallel_prefills": 2, "batched_prefill": False, "captured_prefill": False,
                                   "engine_batcher": None,
                                   "step": None}
    assert r["flow_batching"]["max_batch_size"] == 2 and r["flow_batching"]["max_queue_delay_ms"] == 1.0
    assert "rtf" not in r and "timeline" not in r  # only the concurrency runs
    for key in ("concurrency", "concurrency_offline"):
        assert set(r[key]) == {"1", "2"}
        for level in r[key].values():
            assert level["requests_per_s"] > 0
            assert level["stream_rtf_max"] >= level["rtf"] * 0.5  # one stream is never far faster than all
            for stage in ("flow_estimator", "hift_source", "hift_decoder"):
                assert 1.0 <= level[f"{stage}_mean_batch"] <= 2.0
        assert r[key]["1"]["flow_estimator_mean_batch"] == 1.0


def test_bench_rejects_a_bad_hop_list(tiny_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--bundle", str(tiny_bundle), "--first-hop", "0,x"]) != 0
    assert "--first-hop" in capsys.readouterr().err


def test_timeline_rendering_shows_overlap() -> None:
    events = [StageEvent("llm", 0, 0, 100), StageEvent("flow", 0, 100, 200), StageEvent("llm", 1, 100, 200),
              StageEvent("vocoder", 0, 200, 250), StageEvent("flow", 1, 250, 300)]
    text = render_timeline(events, width=30)
    rows = {line.split("|")[0].strip(): line.split("|")[1] for line in text.splitlines()[1:]}
    assert rows["llm"] == "0" * 10 + "1" * 10 + " " * 10
    assert rows["flow"] == " " * 10 + "0" * 10 + " " * 5 + "1" * 5
    assert rows["vocoder"] == " " * 20 + "0" * 5 + " " * 5
    assert render_timeline([]) == "timeline: no events"


def test_a_bench_stopped_part_way_keeps_what_it_measured(tiny_bundle: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The JSON is rewritten after each section, marked incomplete, so a run cut off at a
    GPU lease's limit (here: the official pipeline fails at the end) still has its figures."""
    import cosyedge_build.reference.pipeline as pipeline

    def broken(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError("the official pipeline is not here")

    monkeypatch.setattr(pipeline, "run_reference", broken)
    out = tmp_path / "partial.json"
    with pytest.raises(RuntimeError, match="not here"):
        main(["bench", "--bundle", str(tiny_bundle), "--repeats", "1", "--concurrency", "1", "--long-seconds", "2",
              "--reference", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["complete"] is False and r["rtf"] > 0
    assert r["concurrency"]["1"]["requests_per_s"] > 0 and r["streaming_cost_vs_offline"]["ratio"] > 0
    assert "reference" not in r


def test_a_failed_request_is_counted_and_the_level_measured_without_it(
        tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One of three concurrent requests raises (the engine's error path on a GPU, injected here):
    the level reports it as failed with its message and measures the two that completed."""
    from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer

    real = CosyVoiceSynthesizer.synthesize

    def flaky(self: CosyVoiceSynthesizer, request: Any) -> Any:
        if request.seed == 1001:  # run_concurrent's second request
            raise KeyError((8, 64, 8))
        return real(self, request)

    monkeypatch.setattr(CosyVoiceSynthesizer, "synthesize", flaky)
    out = tmp_path / "failed.json"
    before = sys.getswitchinterval()
    try:  # the switch interval is the process's: the bench's entry point sets it, and reports it
        assert main(["bench", "--bundle", str(tiny_bundle), "--concurrency", "3", "--concurrency-only",
                     "--python-switch-interval-ms", "0.5", "--json", str(out)]) == 0
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
    assert json.loads(out.read_text())["python_switch_interval_ms"] == 0.5
    level = json.loads(out.read_text())["concurrency"]["3"]
    assert level["failed"] == 1 and level["errors"] == ["KeyError: (8, 64, 8)"]
    assert level["requests_per_s"] > 0 and level["stream_rtf_max"] > 0


def test_level_one_serves_the_largest_levels_requests_one_after_another(
        tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Level 1 is the largest level's requests (the same seeds) one at a time, so a level's rate compares
    with one at a time on the same utterances; level 3 serves the three at once."""
    from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer

    real = CosyVoiceSynthesizer.synthesize
    started: list[tuple[int, int]] = []  # (seed, requests in flight then), the levels' requests only
    in_flight = [0]
    lock = threading.Lock()

    def counted(self: CosyVoiceSynthesizer, request: Any) -> Any:
        if request.seed < 1000:  # the warm-up
            yield from real(self, request)
            return
        with lock:
            in_flight[0] += 1
            started.append((request.seed, in_flight[0]))
        try:
            yield from real(self, request)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(CosyVoiceSynthesizer, "synthesize", counted)
    out = tmp_path / "levels.json"
    assert main(["bench", "--bundle", str(tiny_bundle), "--concurrency", "1,3", "--concurrency-only",
                 "--json", str(out)]) == 0
    levels = json.loads(out.read_text())["concurrency"]
    assert levels["1"]["requests"] == 3 and levels["3"]["requests"] == 3
    assert levels["1"]["failed"] == levels["3"]["failed"] == 0
    one, three = started[:3], started[3:]
    assert one == [(1000, 1), (1001, 1), (1002, 1)]
    assert sorted(seed for seed, _ in three) == [1000, 1001, 1002] and max(n for _, n in three) <= 3


def test_llm_delta_gives_a_levels_steps_and_where_the_graph_batchers_time_went() -> None:
    from cosyedge_models.batching.llm_batcher import BatchStats
    from cosyedge_models.tools.bench_runs import llm_delta

    before = BatchStats(steps=10, shared_steps=4, prefill_s=0.1, step_call_s=0.02, step_host_s=0.005)
    after = BatchStats(steps=38, shared_steps=30, prefill_s=0.188, step_call_s=0.0586, step_host_s=0.0204)
    assert llm_delta(before, after) == {"llm_steps": 28, "llm_shared_steps": 26, "llm_prefill_ms": 88.0,
                                        "llm_step_call_ms": 38.6, "llm_step_host_ms": 15.4}
    # the dynamic-graph batcher counts steps only; no batcher before the level: from zero
    assert llm_delta(None, BatchStats(steps=3, shared_steps=1)) == {"llm_steps": 3, "llm_shared_steps": 1}


def test_order_delta_sums_each_graph_threads_counters_over_a_level() -> None:
    from cosyedge_models.tools.bench_runs import order_delta

    def stats(holds: int, deferred: int, held_ms: float, released: int = 0) -> dict[str, object]:
        return {"runs": {}, "holds": holds, "deferred": deferred, "held_ms": held_ms, "forced": 0, "expired": 0,
                "overtaken": 0, "released": released}

    before = {"decode+flow": stats(1, 3, 10.0, 1)}
    after = {"decode+flow": stats(5, 9, 72.5, 3)}
    assert order_delta(before, after) == {"graph_holds": 4, "graph_llm_held": 6, "graph_held_ms": 62.5,
                                          "graph_forced": 0, "graph_expired": 0, "graph_llm_released": 2}
    # per-stage threads: summed; a thread that had no counters before counts from zero
    assert order_delta({}, {"decode": stats(2, 1, 1.0), "flow": stats(2, 0, 1.5)})["graph_holds"] == 4
    assert order_delta({}, {}) == {}
    # the busy time by label, summed over the threads; labels idle over the level are left out
    before = {"decode": {**stats(0, 0, 0.0), "busy_ms": {"llm_step": 100.0, "vocoder_graph": 5.0}}}
    after = {"decode": {**stats(0, 0, 0.0), "busy_ms": {"llm_step": 340.5, "vocoder_graph": 5.0}},
             "flow": {**stats(0, 0, 0.0), "busy_ms": {"flow_batched_replay": 80.0}}}
    assert order_delta(before, after)["graph_busy_ms"] == {"flow_batched_replay": 80.0, "llm_step": 240.5}
    # and the time it waited in the queues, the same way
    before["decode"]["waited_ms"] = {"llm_step": 12.0}
    after["decode"]["waited_ms"] = {"llm_step": 390.0}
    after["flow"]["waited_ms"] = {"flow_batched_replay": 4.5}
    delta = order_delta(before, after)
    assert delta["graph_waited_ms"] == {"flow_batched_replay": 4.5, "llm_step": 378.0}
    assert "graph_waited_ms" not in order_delta({}, {"decode": stats(0, 0, 0.0)})


def test_flow_batch_delta_gives_a_levels_replays_and_their_mean_time_by_streams_served() -> None:
    from cosyedge_models.tools.bench_runs import flow_batch_delta

    def stats(sizes: dict[int, int], ms: dict[int, float], wait: float) -> dict[str, object]:
        return {"replays": sum(sizes.values()), "rows": sum(n * c for n, c in sizes.items()),
                "shared_replays": sum(c for n, c in sizes.items() if n > 1), "peak_batch": max(sizes, default=0),
                "fallbacks": 0, "moves": 1, "batch_sizes": sizes, "replay_ms": ms, "partner_wait_ms": wait,
                "seeds": sizes.get(1, 0), "reuses": 2 * sizes.get(8, 0),
                "windows": {64: sum(sizes.values())}, "mixed_windows": sizes.get(8, 0),
                "singles": {"alone": sizes.get(1, 0) - 1, "other_step": 1}}

    before = stats({1: 10}, {1: 130.0}, 2.0)
    after = stats({1: 14, 8: 5}, {1: 182.0, 8: 150.0}, 7.5)
    delta = flow_batch_delta(before, after)
    assert delta == {"replays": 9, "rows": 44, "shared_replays": 5, "fallbacks": 0, "moves": 0,
                     "partner_wait_ms": 5.5, "seeds": 4, "reuses": 10, "mixed_windows": 5, "batch_sizes": {1: 4, 8: 5},
                     "replay_ms_mean": {1: 13.0, 8: 30.0}, "windows": {64: 9}, "singles": {"alone": 4}}
    assert flow_batch_delta(None, None) is None
    assert flow_batch_delta(None, after)["replay_ms_mean"] == {1: 13.0, 8: 30.0}  # type: ignore[index]
    # an engine with the later chunks' gather: its holds, held ms and rounds by level
    gathered = flow_batch_delta({**before, "gather_holds": 3, "gather_held_ms": 40.0, "gather_rounds": 2,
                                 "gather_full_rounds": 1, "gather_largest_round": 2},
                                {**after, "gather_holds": 11, "gather_held_ms": 250.5, "gather_rounds": 5,
                                 "gather_full_rounds": 3, "gather_largest_round": 4})
    assert gathered is not None
    assert {k: v for k, v in gathered.items() if k.startswith("gather")} == {
        "gather_holds": 8, "gather_held_ms": 210.5, "gather_rounds": 3, "gather_full_rounds": 2}
    # the lanes refreshed at streams' ends and the seeds that then wrote nothing (lanes.py)
    refreshed = flow_batch_delta({**before, "fresh": 2, "refreshes": 3, "refreshes_dropped": 0},
                                 {**after, "fresh": 12, "refreshes": 14, "refreshes_dropped": 1})
    assert refreshed is not None
    assert {k: refreshed[k] for k in ("fresh", "refreshes", "refreshes_dropped")} == {
        "fresh": 10, "refreshes": 11, "refreshes_dropped": 1}


def test_first_chunk_profile_gives_each_milestone_over_the_streams() -> None:
    from cosyedge_models.synthesis.api import StageEvent
    from cosyedge_models.tools.bench_runs import first_chunk_profile

    def stream(llm_end: float, flow_start: float, flow_end: float, voc_end: float) -> list[StageEvent]:
        return [StageEvent("llm", 0, 1.0, llm_end), StageEvent("llm", 1, llm_end, llm_end + 90),
                StageEvent("flow", 0, flow_start, flow_start + 10), StageEvent("flow", 0, flow_start + 12, flow_end),
                StageEvent("vocoder", 0, flow_end, voc_end), StageEvent("flow", 1, flow_end + 50, flow_end + 80)]

    out = first_chunk_profile([stream(60, 70, 200, 210), stream(80, 90, 400, 420), stream(100, 110, 300, 305)],
                              [20.0, 45.0, None])
    assert out == {"llm_start_ms": {"p50": 1.0, "max": 1.0}, "llm_end_ms": {"p50": 80.0, "max": 100.0},
                   "flow_start_ms": {"p50": 90.0, "max": 110.0}, "flow_end_ms": {"p50": 300.0, "max": 400.0},
                   "vocoder_end_ms": {"p50": 305.0, "max": 420.0}, "first_token_ms": {"p50": 32.5, "max": 45.0},
                   # the stream whose first audio came last, each of its marks
                   "slowest": {"llm_start_ms": 1.0, "first_token_ms": 45.0, "llm_end_ms": 80.0,
                               "flow_start_ms": 90.0, "flow_end_ms": 400.0, "vocoder_end_ms": 420.0}}
    assert first_chunk_profile([]) == {}
    assert "slowest" not in first_chunk_profile([stream(60, 70, 200, 210)])  # one stream: its marks are the p50s


def test_the_engine_gives_its_memory_back_before_the_official_pipeline(tiny_bundle: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside a goals' engine (58.6 GB) the official pipeline did not fit an 80 GB card (twenty-third
    run): the bench closes the engine before it, once, and the pipeline still has the tokenizer."""
    import cosyedge_build.reference.pipeline as pipeline
    from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer

    calls: list[str] = []
    real_close = CosyVoiceSynthesizer.close

    def close(self: CosyVoiceSynthesizer) -> None:
        calls.append("close")
        real_close(self)

    def official(*args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append("official")
        assert len(args[1].encode(args[2])) > 0  # the engine's tokenizer, after its close
        return {"rtf": 0.5, "first_audio_ms": 400.0}

    monkeypatch.setattr(CosyVoiceSynthesizer, "close", close)
    monkeypatch.setattr(pipeline, "run_reference", official)
    out = tmp_path / "ref.json"
    assert main(["bench", "--bundle", str(tiny_bundle), "--repeats", "1", "--concurrency", "1", "--long-seconds", "2",
                 "--reference", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["complete"] is True and r["reference"]["first_audio_ms"] == 400.0
    assert calls[-2:] == ["close", "official"] and calls.count("official") == 1
    assert "close" not in calls[calls.index("official"):]


def test_the_first_chunk_settings_reach_every_measured_stream(tiny_bundle: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """--first-hop-tokens and --first-chunk-euler-steps set the engine's first chunk for the concurrency runs
    (the goals at eight streams with a device's sooner first chunk): a shorter first chunk, and the report says so."""
    from collections.abc import Iterator

    from cosyedge_models.synthesis.api import AudioChunk, SynthesisRequest
    from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer

    first_samples: list[int] = []
    real = CosyVoiceSynthesizer.synthesize

    def synthesize(self: CosyVoiceSynthesizer, request: SynthesisRequest, cancel: Any = None) -> Iterator[AudioChunk]:
        for chunk in real(self, request, cancel):
            if chunk.index == 0 and request.stream:
                first_samples.append(len(chunk.pcm))
            yield chunk

    monkeypatch.setattr(CosyVoiceSynthesizer, "synthesize", synthesize)
    reports = []
    for extra in ([], ["--first-hop-tokens", "5", "--first-chunk-euler-steps", "1"]):
        first_samples.clear()
        out = tmp_path / f"c{len(extra)}.json"
        assert main(["bench", "--bundle", str(tiny_bundle), "--concurrency", "2", "--concurrency-only",
                     "--json", str(out), *extra]) == 0
        reports.append((json.loads(out.read_text()), sorted(set(first_samples))))
    (default, default_first), (sooner, sooner_first) = reports
    assert (default["first_hop_tokens"], default["first_chunk_euler_steps"]) == (None, None)
    assert (sooner["first_hop_tokens"], sooner["first_chunk_euler_steps"]) == (5, 1)
    assert len(sooner_first) == 1 and max(default_first) > sooner_first[0]  # every stream's first chunk is shorter
    assert sooner["concurrency"]["2"]["requests_per_s"] > 0


def test_bench_rejects_more_first_chunk_euler_steps_than_the_bundle_has(tiny_bundle: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--bundle", str(tiny_bundle), "--concurrency", "1", "--concurrency-only",
                 "--first-chunk-euler-steps", "999"]) != 0
    assert "first_chunk_euler_steps" in capsys.readouterr().err


def test_bench_rejects_a_first_hop_shorter_than_the_vocoders_cross_fade(tiny_bundle: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Three tokens of audio are less than the vocoder holds back (the second chunk's cross-fade failed
    with a broadcast error): refused at load, with the least first hop."""
    assert main(["bench", "--bundle", str(tiny_bundle), "--concurrency", "1", "--concurrency-only",
                 "--first-hop-tokens", "3"]) != 0
    assert "first_hop_tokens must be at least 5" in capsys.readouterr().err


def test_each_level_records_what_the_graph_threads_ran(every_graph_bundle: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """graph_trace: every item the graph thread ran in the level's first --graph-trace-ms, in the order they
    started, with their priority; its busy time per label is the level's graph_busy_ms. Offline levels too
    (where their aggregate RTF goes), whose requests open no first-audio hold."""
    out = tmp_path / "trace.json"
    assert main(["bench", "--bundle", str(every_graph_bundle), "--concurrency", "2", "--concurrency-only",
                 "--concurrency-mode", "both", "--graph-flow", "--graph-flow-batch", "--graph-trace-ms", "600000",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    level = r["concurrency"]["2"]
    offline = r["concurrency_offline"]["2"]["graph_trace"]
    assert offline["items"] and {dict(zip(offline["fields"], item, strict=True))["priority"]
                                 for item in offline["items"]} == {"normal"}
    trace = level["graph_trace"]
    rows = [dict(zip(trace["fields"], item, strict=True)) for item in trace["items"]]
    assert rows and trace["dropped"] == 0 and trace["window_ms"] == 600000.0
    assert [row["started_ms"] for row in rows] == sorted(row["started_ms"] for row in rows)
    assert all(0 <= row["submitted_ms"] <= row["started_ms"] <= row["ended_ms"] for row in rows)
    assert {row["thread"] for row in rows} == {"cosyedge-cuda-graphs"}
    # the first chunks' flow inside their first-audio holds, the later chunks' as normal work
    assert {row["priority"] for row in rows} == {"first_audio", "normal"}
    busy: dict[str, float] = {}
    for row in rows:
        busy[row["label"]] = busy.get(row["label"], 0.0) + row["ended_ms"] - row["started_ms"]
    assert set(busy) == set(level["graph_busy_ms"])
    for label, ms in busy.items():  # the same work as the per-label sums (rounded to 0.01 ms an item, 0.1 a sum)
        assert ms == pytest.approx(level["graph_busy_ms"][label], abs=0.2 + 0.01 * len(rows))
    # each batched replay notes its rows, Euler step and window (together, the level's rows), and a turn
    # whose call an earlier turn served notes that
    turns = [row["detail"] for row in rows if row["label"] == "flow_batched_replay"]
    replays = [re.fullmatch(r"rows (\d+), step (\d+), window (\d+)", detail) for detail in turns]
    assert replays and all(m is not None or detail == EMPTY_TURN for m, detail in zip(replays, turns, strict=True))
    assert sum(int(m.group(1)) for m in replays if m) == level["graph_flow_batch"]["rows"]
    assert max(int(m.group(1)) for m in replays if m) == 2  # the two streams shared a replay
    assert "concurrency 2: graph trace: 0 to" in capsys.readouterr().err
    off = tmp_path / "off.json"
    assert main(["bench", "--bundle", str(every_graph_bundle), "--concurrency", "2", "--concurrency-only",
                 "--graph-flow", "--graph-trace-ms", "0", "--json", str(off)]) == 0
    assert "graph_trace" not in json.loads(off.read_text())["concurrency"]["2"]
