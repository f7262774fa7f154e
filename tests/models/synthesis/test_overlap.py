"""Stage overlap in streaming requests: the LLM producer thread runs ahead of
flow + vocoder, the timeline shows it (and shows none in serial mode), the
audio does not change, and cancel / early close / errors stop the producer
and leave no thread behind.

Stage costs are made deterministic by a backend wrapper that sleeps per
session call (tests/models/slow_backend.py); the assertions are about the
order and overlap of intervals, with margins far above scheduling noise."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.errors import SynthesisError
from cosyedge_models.synthesis.api import AudioChunk, StageEvent, SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer

from tests.models.slow_backend import SlowBackend, StagePlan

TEXT = "Hello from the tiny model, one two three."
PRODUCER = "cosyedge-llm"
# Per call: the LLM is the slow stage (a 25-token chunk ~ 500 ms of sleeps), so
# that it never waits for the consumer (a chunk's flow: encoder once + 10
# estimator steps ~ 110 ms of sleeps plus the real work; vocoder ~ 40 ms).
SLOW = {"llm_decode": 0.02, "flow_encoder": 0.03, "flow_estimator": 0.008, "hift_decoder": 0.04}


_OTHERS: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _ignore_other_engines_threads() -> None:
    """Engines of other test modules may still be open: count only the threads a test starts."""
    _OTHERS.clear()
    _OTHERS.update(t for t in threading.enumerate() if t.name.startswith(PRODUCER))


def producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(PRODUCER) and t not in _OTHERS]


def make_engine(bundle: Path, overlap: bool, **plan: dict) -> tuple[CosyVoiceSynthesizer, StagePlan]:  # type: ignore[type-arg]
    stage_plan = StagePlan(**plan)
    engine = CosyVoiceSynthesizer(load_bundle(bundle), SlowBackend(create_backend("ort"), stage_plan),
                             SynthesisSettings(overlap_stages=overlap, threads=1))
    return engine, stage_plan


@pytest.fixture()
def slow_engine(tiny_bundle: Path, request: pytest.FixtureRequest) -> Iterator[tuple[CosyVoiceSynthesizer, StagePlan]]:
    engine, plan = make_engine(tiny_bundle, overlap=request.param, delay_s=SLOW)
    yield engine, plan
    engine.close()
    assert not producer_threads()


def run(engine: CosyVoiceSynthesizer, **kw: object) -> list[AudioChunk]:
    return list(engine.synthesize(SynthesisRequest(**{"text": TEXT, "seed": 3, **kw})))  # type: ignore[arg-type]


def overlap_ms(a: StageEvent, b: StageEvent) -> float:
    return min(a.end_ms, b.end_ms) - max(a.start_ms, b.start_ms)


def by_stage(chunks: list[AudioChunk]) -> dict[str, dict[int, StageEvent]]:
    out: dict[str, dict[int, StageEvent]] = {"llm": {}, "flow": {}, "vocoder": {}}
    for e in chunks[-1].times.timeline:
        assert e.chunk not in out[e.stage], f"two {e.stage} events for chunk {e.chunk}"
        assert 0 <= e.start_ms <= e.end_ms
        out[e.stage][e.chunk] = e
    return out


@pytest.mark.parametrize("slow_engine", [True], indirect=True)
def test_with_overlap_the_llm_of_the_next_chunk_runs_during_flow_and_vocoder(slow_engine: tuple) -> None:  # type: ignore[type-arg]
    engine, _ = slow_engine
    chunks = run(engine)
    ev = by_stage(chunks)
    n = len(chunks)
    assert n >= 3 and set(ev["flow"]) == set(ev["vocoder"]) == set(range(n))
    assert set(ev["llm"]) == set(range(n))
    for i in range(n - 1):
        consumer = StageEvent("flow", i, ev["flow"][i].start_ms, ev["vocoder"][i].end_ms)
        # The LLM went on as soon as chunk i's tokens were out, before flow i started
        # (the consumer only starts flow after receiving them) ...
        assert ev["llm"][i + 1].start_ms <= ev["flow"][i].start_ms
        # ... and, being the slower stage, was busy through most of chunk i's flow + vocoder.
        busy = sum(max(0.0, overlap_ms(ev["llm"][j], consumer)) for j in range(i + 1, n))
        assert busy > 0.5 * (consumer.end_ms - consumer.start_ms), (i, busy, consumer)
    # Flow and vocoder stay ordered on the consumer, chunk after chunk.
    for i in range(n):
        assert ev["flow"][i].end_ms <= ev["vocoder"][i].start_ms
        assert ev["llm"][i].end_ms <= ev["flow"][i].start_ms


@pytest.mark.parametrize("slow_engine", [False], indirect=True)
def test_serial_mode_shows_no_overlap(slow_engine: tuple) -> None:  # type: ignore[type-arg]
    engine, _ = slow_engine
    chunks = run(engine)
    ev = by_stage(chunks)
    assert len(chunks) >= 3 and not producer_threads()
    consumer = list(ev["flow"].values()) + list(ev["vocoder"].values())
    for llm in ev["llm"].values():
        for other in consumer:
            assert overlap_ms(llm, other) <= 0.01, (llm, other)


def test_overlap_gives_the_same_audio_as_serial(tiny_bundle: Path) -> None:
    pcm = {}
    for overlap in (True, False):
        engine, _ = make_engine(tiny_bundle, overlap)
        try:
            chunks = run(engine)
            pcm[overlap] = np.concatenate([c.pcm for c in chunks])
            assert chunks[-1].times.llm_tokens > 0 and chunks[-1].last
        finally:
            engine.close()
    assert np.array_equal(pcm[True], pcm[False])
    assert not producer_threads()


@pytest.mark.parametrize("how", ["cancel", "close", "break"])
def test_cancel_or_early_close_stops_the_producer(tiny_bundle: Path, how: str) -> None:
    # The LLM is the slow stage here (25 ms a token): a producer left running would keep stepping.
    engine, plan = make_engine(tiny_bundle, overlap=True, delay_s={"llm_decode": 0.025})
    try:
        for _ in range(3):  # requests one after another reuse one producer thread
            cancel = threading.Event()
            gen = engine.synthesize(SynthesisRequest(text=TEXT, seed=3), cancel)
            first = next(gen)
            assert first.index == 0
            t0 = time.perf_counter()
            if how == "cancel":
                cancel.set()
                assert list(gen) == []
            elif how == "close":
                gen.close()
            else:
                for _chunk in gen:
                    break
                del gen  # the caller dropping the generator after a break
            stopped_in = time.perf_counter() - t0
            steps = plan.calls["llm_decode"]
            time.sleep(0.15)  # 6 more steps if it were still running
            assert plan.calls["llm_decode"] == steps, "the producer kept decoding"
            assert stopped_in < 1.0
            assert len(producer_threads()) == 1
    finally:
        engine.close()
    assert not producer_threads()


@pytest.mark.parametrize("overlap", [True, False])
def test_an_error_on_the_producer_reaches_the_caller_with_its_type(tiny_bundle: Path, overlap: bool) -> None:
    engine, _ = make_engine(tiny_bundle, overlap=overlap, fail_after={"llm_decode": 40})
    try:
        got: list[AudioChunk] = []
        with pytest.raises(SynthesisError, match="llm_decode: injected failure"):
            for chunk in engine.synthesize(SynthesisRequest(text=TEXT, seed=3)):
                got.append(chunk)
        assert got, "chunks before the failure are delivered"
        assert len(producer_threads()) == (1 if overlap else 0)
    finally:
        engine.close()
    assert not producer_threads()


def test_flow_error_stops_the_producer(tiny_bundle: Path) -> None:
    engine, plan = make_engine(tiny_bundle, overlap=True, delay_s={"llm_decode": 0.01},
                               fail_after={"flow_encoder": 1})
    try:
        with pytest.raises(SynthesisError, match="flow_encoder"):
            run(engine)
        steps = plan.calls["llm_decode"]
        time.sleep(0.1)
        assert plan.calls["llm_decode"] == steps
    finally:
        engine.close()
    assert not producer_threads()


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="producer_threads"):
        SynthesisSettings(producer_threads=0)
    with pytest.raises(ValueError, match="overlap_queue_tokens"):
        SynthesisSettings(overlap_queue_tokens=0)


def test_overlap_auto_resolution() -> None:
    from cosyedge_models.synthesis.synthesizer import resolve_overlap

    assert resolve_overlap(True, "ort", 2) and not resolve_overlap(False, "ort-cuda", 64)
    assert not resolve_overlap(None, "ort", 2) and not resolve_overlap(None, "ort", None)
    assert resolve_overlap(None, "ort", 4) and resolve_overlap(None, "ort-cuda", 2) and resolve_overlap(None, "trt", 1)
