"""Flow estimator and HiFT calls batched across requests
(models/batching/stage_batcher.py, models/batching/stage_merge.py): merged calls give each
request what it gets alone (up to float reassociation in the bigger GEMMs),
with ragged lengths padded and masked; the queue honours the batch size,
the delay and priorities; errors reach exactly the calls of the failed run;
nothing hangs when the worker is gone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.profiles import all_input_ranges
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.batching.stage_batcher import StageBatcher, call_priority, current_priority
from cosyedge_models.batching.stage_merge import (
    Axes,
    AxisMerger,
    estimator_merger,
    hift_decoder_merger,
    hift_source_merger,
    profile_fits,
)
from cosyedge_models.errors import SynthesisError
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.flow import FlowPrompt
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer
from cosyedge_models.synthesis.vocoder import HiftVocoder

TEXTS = ["Hello world one two.", "The quick brown fox jumps over the lazy dog", "A", "Numbers and dates today"]
TOL = 1e-5  # estimator outputs and mel: float reassociation only


class Recorder:
    """A session that keeps the feeds of every call."""

    def __init__(self, inner: Session) -> None:
        self.inner = inner
        self.name, self.input_names, self.output_names = inner.name, inner.input_names, inner.output_names
        self.feeds: list[dict[str, np.ndarray]] = []

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        self.feeds.append(dict(inputs))
        return self.inner.run(inputs, outputs)

    def memory_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class RowSum:
    """A fake graph: out[n, t] = running sum of x[n, :t+1] * mask (causal,
    masked: right padding must not change the valid frames); counts runs."""

    def __init__(self, fail_on: set[int] | None = None) -> None:
        self.name = "fake"
        self.input_names: tuple[str, ...] = ("x", "mask")
        self.output_names: tuple[str, ...] = ("y",)
        self.runs: list[int] = []  # rows per run
        self.fail_on = fail_on or set()

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        self.runs.append(int(inputs["x"].shape[0]))
        if len(self.runs) in self.fail_on:
            raise RuntimeError("injected failure")
        return {"y": np.cumsum(inputs["x"] * inputs["mask"], axis=1)}

    def memory_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


ROW_MERGER = AxisMerger({"x": Axes(0, 1), "mask": Axes(0, 1)}, {"y": Axes(0, 1)}, time_ref="x")


def row_call(length: int, seed: int) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((1, length)).astype(np.float32)
    return {"x": x, "mask": np.ones_like(x)}


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_ragged_calls_are_padded_merged_and_split_back() -> None:
    # 9 and 12 share a run with 10 (each >= 75% of the padded 12); 5 would be mostly padding: next run
    calls = [row_call(n, i) for i, n in enumerate((10, 5, 9, 12))]
    session = RowSum()
    batcher = StageBatcher(session, ROW_MERGER, BatchSettings(max_batch_size=4))
    futures = [batcher.submit(c) for c in calls]
    assert batcher.run_once() == (True, None)
    assert session.runs == [3]
    assert [f is not None and f.future.done() for f in futures] == [True, False, True, True]
    batcher.run_once()
    assert session.runs == [3, 1]
    for c, f in zip(calls, futures, strict=True):
        assert f is not None
        np.testing.assert_array_equal(f.future.result()["y"], np.cumsum(c["x"], axis=1))
    assert batcher.stats.as_dict() == {"runs": 2, "calls": 4, "largest": 3, "alone": 0, "mean_batch": 2.0}
    assert AxisMerger(ROW_MERGER.inputs, ROW_MERGER.outputs, "x", min_fill=0.0).select(calls) == [0, 1, 2, 3]


def test_calls_that_cannot_merge_run_alone_on_the_callers_thread() -> None:
    batcher = StageBatcher(RowSum(), ROW_MERGER, BatchSettings())
    assert batcher.submit({"x": np.zeros((1, 3), np.float32)}) is None  # an input missing: another graph
    assert batcher.submit(row_call(3, 0), outputs=["other"]) is None
    assert batcher.stats.alone == 2
    # Other dims must agree exactly: a [1, 3] and a [1, 3, 2] input never share a key.
    assert ROW_MERGER.key(row_call(3, 0), None) == ROW_MERGER.key(row_call(7, 1), None)
    assert ROW_MERGER.key(row_call(3, 0), None) != ROW_MERGER.key({"x": np.zeros((1, 3, 2), np.float32),
                                                                  "mask": np.ones((1, 3, 2), np.float32)}, None)


def test_estimator_keys_separate_cache_lengths() -> None:
    merger = estimator_merger()

    def feeds(t: int, s: int, r: int) -> dict[str, np.ndarray]:
        return {"x": np.zeros((2, 4, t), np.float32), "mask": np.ones((2, 1, t), np.float32),
                "mu": np.zeros((2, 4, t), np.float32), "cond": np.zeros((2, 4, t), np.float32),
                "t": np.zeros(2, np.float32), "spks": np.zeros((2, 4), np.float32),
                "chunk_frames": np.zeros(2, np.int64), "att_cache": np.zeros((s, 3, 2, 2, 2, 8), np.float32),
                "conv_cache": np.zeros((5, 2, 16, 2), np.float32), "commit": np.zeros(r, np.float32)}

    assert merger.key(feeds(10, 0, 0), None) == merger.key(feeds(33, 0, 0), None)
    assert merger.key(feeds(10, 0, 0), None) != merger.key(feeds(10, 50, 0), None)  # cached keys: all visible
    assert merger.key(feeds(10, 0, 0), None) != merger.key(feeds(10, 0, 4), None)
    assert estimator_merger(pad_time=False).key(feeds(10, 0, 0), None) != \
        estimator_merger(pad_time=False).key(feeds(33, 0, 0), None)


@pytest.fixture(scope="module")
def prompt(engine: CosyVoiceSynthesizer) -> FlowPrompt:
    return engine.conditioning.build(SynthesisRequest(text="hi")).flow


def test_estimator_calls_of_different_lengths_and_steps_merge_exactly(engine: CosyVoiceSynthesizer,
                                                                      prompt: FlowPrompt) -> None:
    flow = engine.flow
    recorder = Recorder(flow.estimator)
    flow.estimator = recorder
    try:
        rng = np.random.default_rng(0)
        for n in (40, 33, 36):  # frames within MIN_FILL of each other
            flow.mel(rng.integers(0, 100, n), prompt, finalize=True, streaming=False)
    finally:
        flow.estimator = recorder.inner
    steps = flow.config.n_timesteps
    # request 0 at its first Euler step, 1 at its fourth, 2 at its last: t differs per row
    feeds = [recorder.feeds[0], recorder.feeds[steps + 3], recorder.feeds[3 * steps - 1]]
    assert len({f["x"].shape[2] for f in feeds}) == 3 and len({float(f["t"][0]) for f in feeds}) == 3
    alone = [recorder.inner.run(f) for f in feeds]
    batcher = StageBatcher(recorder.inner, estimator_merger(), BatchSettings(max_batch_size=4))
    calls = [batcher.submit(f) for f in feeds]
    batcher.run_once()
    assert batcher.stats.largest == 3
    for a, c in zip(alone, calls, strict=True):
        assert c is not None
        got = c.future.result()
        assert got["dphi_dt"].shape == a["dphi_dt"].shape
        assert float(np.abs(got["dphi_dt"] - a["dphi_dt"]).max()) < TOL
        np.testing.assert_array_equal(got["conv_cache_new"], a["conv_cache_new"])


def run_threads(n: int, work: Any) -> dict[int, Any]:
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    if errors:
        raise errors[0]
    return results


def test_streaming_windows_in_lockstep_merge_with_their_caches(engine: CosyVoiceSynthesizer,
                                                               prompt: FlowPrompt) -> None:
    """Two streams of the same schedule have equal cache lengths at every
    window, so their cached windows merge too (each row its own cache). Once
    a call returned its thread is expected back, so the two stay paired (the
    worker starts once both first calls wait, so they start paired)."""
    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, 100, 80) for _ in range(2)]
    hops = (20, 45, 70)

    def stream_mel(i: int) -> np.ndarray:
        s = engine.flow.stream(prompt, "cached")
        parts = [s.push(tokens[i][:h]) for h in hops] + [s.finish(tokens[i])]
        return np.concatenate(parts, axis=2)

    alone = {i: stream_mel(i) for i in range(2)}
    inner = engine.flow.estimator
    # Preferred size 2 and a long delay: every call waits for its partner.
    batcher = StageBatcher(inner, estimator_merger(), BatchSettings(max_batch_size=2, max_queue_delay_ms=10_000))
    engine.flow.estimator = batcher

    def start_when_both_wait() -> None:
        while batcher.waiting < 2:
            time.sleep(0.0005)
        batcher.start()

    starter = threading.Thread(target=start_when_both_wait)
    starter.start()
    try:
        merged = run_threads(2, stream_mel)
    finally:
        starter.join(10)
        engine.flow.estimator = inner
        batcher.stop()
    assert batcher.stats.runs == batcher.stats.calls // 2 and batcher.stats.largest == 2
    for i in range(2):
        assert merged[i].shape == alone[i].shape
        assert float(np.abs(merged[i] - alone[i]).max()) < TOL


def test_vocoder_calls_of_equal_length_merge_and_keep_their_noise(engine: CosyVoiceSynthesizer) -> None:
    voc: HiftVocoder = engine.vocoder
    frames = 30
    feeds = []
    for i in range(3):
        rng = np.random.default_rng(i)
        mel = rng.standard_normal((1, engine.bundle.mel_bins, frames)).astype(np.float32) - 5
        noise = rng.standard_normal((1, frames * voc.upsample, voc.harmonics)).astype(np.float32)
        feeds.append({"mel": mel, "noise": noise})
    for session, merger, make in ((voc.source_session, hift_source_merger(), lambda f: f),
                                  (voc.decoder_session, hift_decoder_merger(),
                                   lambda f: {"mel": f["mel"], "source": voc.source_session.run(f)["source"]})):
        calls = [make(f) for f in feeds]
        alone = [session.run(c) for c in calls]
        batcher = StageBatcher(session, merger, BatchSettings(max_batch_size=4))
        futures = [batcher.submit(c) for c in calls]
        # a call of another length waits for a batch of its own
        other = batcher.submit({k: v[:, :, :-1] if k == "mel" else v[:, : -voc.upsample] for k, v in calls[0].items()})
        batcher.run_once()
        assert batcher.stats.largest == 3 and other is not None and not other.future.done()
        for a, f in zip(alone, futures, strict=True):
            assert f is not None
            got = f.future.result()
            (name,) = got
            assert got[name].shape == a[name].shape and float(np.abs(got[name] - a[name]).max()) < TOL
        batcher.run_once()
        assert other.future.done()


def submit_elsewhere(batcher: StageBatcher, feeds: dict[str, np.ndarray]) -> Any:
    """Submit from another thread (another request)."""
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(batcher.submit(feeds)))
    t.start()
    t.join()
    return box[0]


def test_a_call_waits_only_for_callers_expected_back_and_at_most_the_delay() -> None:
    clock = FakeClock()
    session = RowSum()
    batcher = StageBatcher(session, ROW_MERGER, BatchSettings(max_batch_size=4, max_queue_delay_ms=50), clock=clock)
    a = batcher.submit(row_call(3, 0))
    assert batcher.run_once() == (True, None) and session.runs == [1]  # a lone request never waits
    assert a is not None and a.future.done()
    # This thread's call just returned: it is expected back, so another request's call waits for it ...
    clock.t = 100.01
    b = submit_elsewhere(batcher, row_call(5, 1))
    assert batcher.run_once() == (False, pytest.approx(100.05))  # ... until this thread's call is 50 ms old
    c = batcher.submit(row_call(4, 2))  # back: nobody else is expected, both run now
    assert batcher.run_once()[0] is True and session.runs == [1, 2]
    assert b.future.done() and c is not None and c.future.done()
    # Both threads are expected now; only one comes back: it waits until the other's 50 ms are over.
    d = submit_elsewhere(batcher, row_call(2, 3))
    assert batcher.run_once() == (False, pytest.approx(100.06))
    clock.t = 100.06
    assert batcher.run_once()[0] is True and session.runs == [1, 2, 1] and d.future.done()


def test_preferred_sizes_and_priority() -> None:
    clock = FakeClock()
    session = RowSum()
    batcher = StageBatcher(session, ROW_MERGER, BatchSettings(max_batch_size=4, preferred_batch_sizes=(2,),
                                                              max_queue_delay_ms=50), clock=clock)
    batcher.submit(row_call(3, 0))
    batcher.run_once()  # this thread is now expected back
    a = submit_elsewhere(batcher, row_call(3, 1))
    assert batcher.run_once()[0] is False
    b = submit_elsewhere(batcher, row_call(4, 2))  # the preferred size is reached: both run before the delay
    assert batcher.run_once()[0] is True and session.runs == [1, 2]
    assert a.future.done() and b.future.done()

    # max_batch_size 1: the higher priority runs first, FIFO within a priority
    one = StageBatcher(session, ROW_MERGER, BatchSettings(max_batch_size=1), clock=clock)
    low = one.submit(row_call(3, 0), priority=0)
    with call_priority(5):
        assert current_priority() == 5
        high = one.submit(row_call(3, 1))
    assert current_priority() == 0
    one.run_once()
    assert high is not None and low is not None and high.future.done() and not low.future.done()
    one.run_once()
    assert low.future.done()


def test_a_failed_batched_run_fails_its_calls_and_the_worker_goes_on() -> None:
    session = RowSum(fail_on={1})
    batcher = StageBatcher(session, ROW_MERGER, BatchSettings(max_batch_size=2))
    first = [batcher.submit(row_call(3 + i, i)) for i in range(2)]
    with batcher:  # the worker starts with both calls waiting: one merged run, which fails
        for call in first:
            assert call is not None
            with pytest.raises(SynthesisError, match="fake: batched run of 2 requests failed: injected failure"):
                call.future.result(timeout=10)
        again = run_threads(2, lambda i: batcher.run(row_call(3 + i, i)))
    for i, out in again.items():
        np.testing.assert_array_equal(out["y"], np.cumsum(row_call(3 + i, i)["x"], axis=1))
    assert session.runs[0] == 2 and sum(session.runs[1:]) == 2


def test_stop_and_a_missing_worker_never_hang() -> None:
    batcher = StageBatcher(RowSum(), ROW_MERGER, BatchSettings())
    with pytest.raises(SynthesisError, match="stage batcher is not running"):
        batcher.run(row_call(3, 0))  # never started: the caller gives up instead of waiting
    assert batcher.waiting == 0
    pending = batcher.submit(row_call(3, 0))
    batcher.stop()
    assert pending is not None
    with pytest.raises(SynthesisError, match="stopped before the call ran"):
        pending.future.result(timeout=1)
    with pytest.raises(SynthesisError, match="stage batcher is stopped"):
        batcher.run(row_call(3, 0))


def test_a_full_queue_runs_the_call_alone() -> None:
    session = RowSum()
    batcher = StageBatcher(session, ROW_MERGER, BatchSettings(max_queue_size=1))
    assert batcher.submit(row_call(3, 0)) is not None
    out = batcher.run(row_call(4, 1))  # the queue is full: on this thread, no worker needed
    np.testing.assert_array_equal(out["y"], np.cumsum(row_call(4, 1)["x"], axis=1))
    assert batcher.stats.alone == 1 and batcher.waiting == 1


def test_trt_profiles_cap_the_merged_batch(engine: CosyVoiceSynthesizer, prompt: FlowPrompt) -> None:
    """The estimator's offline profile takes 4 requests (N <= 8), its streaming
    profile one (N == 2): streaming windows with commits then run one by one."""
    fits = profile_fits(all_input_ranges(engine.bundle.stages["flow_estimator"].raw, "flow_estimator"))
    recorder = Recorder(engine.flow.estimator)
    engine.flow.estimator = recorder
    try:
        engine.flow.mel(np.arange(20), prompt, finalize=True, streaming=False)
        engine.flow.stream(prompt, "cached").push(np.arange(60))
    finally:
        engine.flow.estimator = recorder.inner
    offline, window = recorder.feeds[0], recorder.feeds[-1]
    assert window["commit"].shape[0] > 0
    session = RowSum()  # never run: only the admission is looked at
    for feeds, expected in ((offline, 4), (window, 1)):
        batcher = StageBatcher(session, estimator_merger(), BatchSettings(max_batch_size=6), fits=fits)
        calls = [batcher.submit(feeds) for _ in range(6)]
        assert all(c is not None for c in calls)
        picked, _ = batcher._pick(batcher.clock())
        assert len(picked) == expected


@pytest.fixture(scope="module")
def flow_batched(tiny_bundle: Path) -> Iterator[CosyVoiceSynthesizer]:
    # A delay long enough for the four requests' LLMs to finish: their flows then run in lockstep.
    settings = BatchSettings(max_batch_size=4, max_queue_delay_ms=300)
    eng = load_synthesizer(tiny_bundle, settings=SynthesisSettings(flow_batching=settings))
    yield eng
    eng.close()


def _gate_first_batch(monkeypatch: pytest.MonkeyPatch, batcher: StageBatcher, calls: int) -> None:
    """The batcher's first run waits (30 s at most) until `calls` calls are queued: the requests' first
    estimator calls then meet whatever the machine's load does to their timing (a full CI-sized run once
    merged none: each request's LLM finished alone, and a lone call never waits)."""
    deadline = time.monotonic() + 30
    released = threading.Event()
    run_once = batcher.run_once

    def gated() -> tuple[bool, float | None]:
        if not released.is_set():
            if batcher.waiting < calls and time.monotonic() < deadline:
                return False, batcher.clock() + 0.005
            released.set()
        return run_once()

    monkeypatch.setattr(batcher, "run_once", gated)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_output_is_the_same_alone_and_flow_batched(engine: CosyVoiceSynthesizer,
                                                          flow_batched: CosyVoiceSynthesizer, stream: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def synth(eng: CosyVoiceSynthesizer, i: int) -> tuple[np.ndarray, int]:
        chunks = list(eng.synthesize(SynthesisRequest(text=TEXTS[i], seed=20 + i, stream=stream)))
        return np.concatenate([c.pcm for c in chunks]), int(chunks[-1].times.llm_tokens)

    alone = {i: synth(engine, i) for i in range(4)}
    estimator = next(b for b in flow_batched.stage_batchers if b.name == "flow_estimator")
    _gate_first_batch(monkeypatch, estimator, 4)
    before = {b.name: b.stats.calls - b.stats.runs for b in flow_batched.stage_batchers}
    batched = run_threads(4, lambda i: synth(flow_batched, i))
    merged = {b.name: b.stats.calls - b.stats.runs - before[b.name] for b in flow_batched.stage_batchers}
    assert merged["flow_estimator"] > 0, "no estimator calls were merged"
    for i in range(4):
        assert batched[i][1] == alone[i][1]  # seeded tokens: the same
        assert batched[i][0].shape == alone[i][0].shape
        # HiFT turns the mel's float noise into ~3x more in the samples
        assert float(np.abs(batched[i][0] - alone[i][0]).max()) < 1e-4


def test_engine_settings_check_flow_batching() -> None:
    with pytest.raises(ValueError, match="flow_batching must be a BatchSettings or None, got int"):
        SynthesisSettings(flow_batching=4)  # type: ignore[arg-type]
