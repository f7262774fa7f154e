"""Bounded memory of `build quantize`: feeds on disk, the estimate checked
before the run, and the progress lines of long build work."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from cosyedge_build.quantize.capture import MAX_OFFLINE_ESTIMATOR_FRAMES, FeedStore, bounded_feed
from cosyedge_build.quantize.feed_files import DiskFeeds
from cosyedge_build.quantize.memory import (
    ACTIVATION_FACTOR,
    BASE_BYTES,
    ENGINE_ACTIVATION_FACTOR,
    ENGINE_FACTOR,
    GIB,
    QuantizeMemoryError,
    available_bytes,
    check_fits,
    estimate_peak,
)
from cosyedge_build.quantize.pipeline import quantize_bundle
from cosyedge_build.quantize.settings import QuantizeSettings
from cosyedge_models.tools.progress import StageProgress, eta_seconds


def test_disk_feed_store_keeps_the_same_feeds_as_the_memory_one(tmp_path: Path) -> None:
    memory, disk = FeedStore(cap=5, seed=3), FeedStore(cap=5, seed=3, directory=tmp_path / "feeds")
    rng = np.random.default_rng(0)
    for i in range(60):
        feed = {"x": rng.standard_normal((2, 3)).astype(np.float32), "n": np.array([i], np.int64)}
        memory.add("llm_decode", feed)
        disk.add("llm_decode", feed)
    kept = disk.feeds["llm_decode"]
    assert isinstance(kept, DiskFeeds) and len(kept) == 5
    assert [int(f["n"][0]) for f in kept] == [int(f["n"][0]) for f in memory.feeds["llm_decode"]]
    for a, b in zip(kept, memory.feeds["llm_decode"], strict=True):
        assert a["x"].dtype == np.float32 and np.array_equal(a["x"], b["x"])
    # replaced slots leave no stale files behind: 5 slots of 2 arrays
    assert len(list((tmp_path / "feeds" / "llm_decode").rglob("*.npy"))) == 10
    assert disk.nbytes() >= memory.nbytes() > 0


def _estimator_feed(frames: int, cache: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(frames + cache)
    return {"x": rng.standard_normal((2, 80, frames), dtype=np.float32),
            "mu": rng.standard_normal((2, 80, frames), dtype=np.float32),
            "cond": rng.standard_normal((2, 80, frames), dtype=np.float32),
            "mask": np.ones((2, 1, frames), np.float32), "t": np.full(2, 0.3, np.float32),
            "spks": np.zeros((2, 80), np.float32), "chunk_frames": np.full(2, 0 if not cache else 50, np.int64),
            "att_cache": np.zeros((cache, 3, 2, 2, 2, 4), np.float32),
            "conv_cache": np.zeros((3, 2, 8, 2), np.float32), "commit": np.zeros(50 if cache else 0, np.float32)}


def test_long_offline_estimator_feeds_are_cut_to_their_first_frames(tmp_path: Path) -> None:
    n = MAX_OFFLINE_ESTIMATOR_FRAMES
    long = _estimator_feed(n + 740, 0)
    cut = bounded_feed("flow_estimator", long)
    for k in ("x", "mu", "cond", "mask"):
        assert cut[k].shape[-1] == n
        np.testing.assert_array_equal(cut[k], long[k][..., :n])
    for k in ("t", "spks", "chunk_frames", "att_cache", "conv_cache", "commit"):
        assert cut[k] is long[k]
    # streaming windows over a cache, short offline feeds and other stages stay whole
    stream = _estimator_feed(50, n + 1000)
    assert bounded_feed("flow_estimator", stream) is stream
    short = _estimator_feed(n, 0)
    assert bounded_feed("flow_estimator", short) is short
    other = {"x": np.zeros((2, 80, n + 10), np.float32)}
    assert bounded_feed("flow_encoder", other) is other
    # the store keeps the cut feed
    store = FeedStore(cap=4, directory=tmp_path)
    store.add("flow_estimator", long)
    assert store.feeds["flow_estimator"][0]["x"].shape[-1] == n


def test_disk_feeds_index_and_slice(tmp_path: Path) -> None:
    feeds = DiskFeeds(tmp_path)
    for i in range(3):
        feeds.put(i, {"a": np.full((2,), i)})
    assert [int(f["a"][0]) for f in feeds[1:]] == [1, 2] and int(feeds[-1]["a"][0]) == 2
    with pytest.raises(IndexError):
        feeds.put(5, {"a": np.zeros(1)})
    with pytest.raises(IndexError):
        _ = feeds[3]


def test_estimate_counts_shared_llm_weights_once() -> None:
    sizes = {"llm_prefill": 10 * GIB // 10, "llm_decode": 10 * GIB // 10, "flow_estimator": GIB // 4,
             "hift_decoder": GIB // 16}
    unshared = estimate_peak(sizes, ["llm_prefill", "llm_decode", "flow_estimator"], "int8")
    shared = estimate_peak(sizes, ["llm_prefill", "llm_decode", "flow_estimator"], "int8", shared_llm_bytes=GIB)
    assert shared.phases["capture"] < unshared.phases["capture"]
    # one graph at a time: the largest graph with its calibration activations sets the quantization
    # phase, whatever the number of graphs (here the estimator's activations outweigh the LLM)
    assert shared.phases["quantize_graph"] == int(GIB // 4 * (4.0 + ACTIVATION_FACTOR["flow_estimator"])) + BASE_BYTES
    # the engine's activations over long utterances (the offline flow) count in capture
    no_flow = estimate_peak({k: v for k, v in sizes.items() if k != "flow_estimator"}, ["llm_prefill"], "int8",
                            shared_llm_bytes=GIB)
    extra = shared.phases["capture"] - no_flow.phases["capture"]
    assert extra == int(GIB // 4 * (ENGINE_FACTOR + ENGINE_ACTIVATION_FACTOR["flow_estimator"]))
    llm_only = estimate_peak(sizes, ["llm_prefill", "llm_decode"], "int8", shared_llm_bytes=GIB)
    assert llm_only.phases["quantize_graph"] == int(GIB * 4.0) + BASE_BYTES
    assert shared.peak_bytes == max(shared.phases.values())


def test_check_fits_refuses_before_the_run_with_the_figures() -> None:
    est = estimate_peak({"llm_prefill": 4 * GIB}, ["llm_prefill"], "int8")
    check_fits(est, available=64 * GIB)
    with pytest.raises(QuantizeMemoryError, match=r"would need about 16\.6 GiB.*available memory \(8\.0 GiB\)"):
        check_fits(est, available=8 * GIB)
    with pytest.raises(QuantizeMemoryError, match="--max-memory-gb limit"):
        check_fits(est, available=64 * GIB, limit=2 * GIB)


def test_available_bytes_reads_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   12345678 kB\n")
    assert available_bytes(meminfo) == 12345678 * 1024
    assert available_bytes(tmp_path / "missing") is None


def test_quantize_refuses_to_start_when_it_would_not_fit(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "int8"
    with pytest.raises(QuantizeMemoryError, match="nothing was started"):
        quantize_bundle(tiny_bundle, out, QuantizeSettings(max_memory_gb=0.01))
    assert not out.exists() and not list(tmp_path.iterdir())


def test_progress_lines_without_a_terminal() -> None:
    stream = io.StringIO()
    with StageProgress("quantize int8", 2, stream=stream) as progress:
        progress.advance("calibration text 1/1")
        progress.advance("unit llm")
        progress.advance("one more than planned")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "quantize int8: calibration text 1/1 done (1/2)" in lines[0]
    assert "ETA" in lines[0] and "(3/3)" in lines[2]


def test_progress_bar_on_a_terminal() -> None:
    stream = io.StringIO()
    with StageProgress("export", 3, stream=stream, bar=True) as progress:
        progress.advance("LLM graphs")
    assert "export: LLM graphs" in stream.getvalue() and "1/3" in stream.getvalue()


def test_eta() -> None:
    assert eta_seconds(0, 4, 10.0) is None
    assert eta_seconds(1, 4, 10.0) == pytest.approx(30.0)
    assert eta_seconds(4, 4, 10.0) == 0.0
