"""Later chunks' flow starts held together (models/synthesis/flow_gather.py, graph_flow_gather_ms): the
hold's budget out of a stream's queued audio, the rounds' releases, and an engine whose streams gather
and give the audio they give without it."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.flow_gather import GATHER_MARGIN_S, FlowGather, hold_budget_s, queued_audio_s
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer


def test_a_hold_is_paid_out_of_the_audio_queued_beyond_the_margin() -> None:
    # 3 s sent, playback began 1 s ago: 2 s queued
    assert queued_audio_s(3.0, first_audio_at=10.0, now=11.0) == pytest.approx(2.0)
    assert hold_budget_s(0.1, 2.0) == pytest.approx(0.1)  # the setting's cap
    assert hold_budget_s(1.0, GATHER_MARGIN_S + 0.2) == pytest.approx(0.2)  # what is left beyond the margin
    assert hold_budget_s(1.0, GATHER_MARGIN_S) == 0.0
    assert hold_budget_s(1.0, queued_audio_s(1.0, 10.0, 12.0)) == 0.0  # playback ahead of the audio: no hold


def _hold_in_thread(gather: FlowGather, budget_s: float, out: list[float]) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(gather.hold(budget_s)))
    t.start()
    return t


def test_holders_go_together_once_every_seated_stream_holds() -> None:
    told: list[list[int]] = []  # the threads of each round released together (FlowBatcher.expect)
    gather = FlowGather(1.0, seated=lambda: 2, released=lambda threads: told.append(sorted(threads)))
    held: list[float] = []
    first = _hold_in_thread(gather, 5.0, held)
    time.sleep(0.1)
    assert first.is_alive()  # waits for the other seated stream
    t0 = time.monotonic()
    second = gather.hold(5.0)
    first.join(5)
    assert not first.is_alive() and time.monotonic() - t0 < 1.0
    assert second < 0.5 and 0.05 < held[0] < 2.0
    assert told == [sorted([first.ident or 0, threading.get_ident()])]
    lone = FlowGather(1.0, seated=lambda: 1, released=lambda threads: told.append(threads))
    assert lone.hold(5.0) < 0.5 and len(told) == 1  # a round of one: no partner to expect
    assert gather.report() == {"gather_holds": 2, "gather_held_ms": pytest.approx(gather.stats.held_s * 1e3, abs=0.1),
                               "gather_rounds": 1, "gather_full_rounds": 1, "gather_largest_round": 2}


def test_holders_go_at_the_first_holders_time_when_a_seated_stream_does_not_come() -> None:
    gather = FlowGather(1.0, seated=lambda: 3)
    held: list[float] = []
    first = _hold_in_thread(gather, 0.3, held)
    time.sleep(0.05)
    second = gather.hold(5.0)  # released with the first at ~0.3 s, not at its own 5 s
    first.join(5)
    assert 0.2 < held[0] < 2.0 and 0.1 < second < 2.0
    stats = gather.stats
    assert (stats.rounds, stats.full_rounds, stats.largest_round) == (1, 0, 2)
    # a new round starts after a release: a lone holder (of three seated) waits its own time
    t0 = time.monotonic()
    assert gather.hold(0.05) >= 0.04 and time.monotonic() - t0 < 1.0
    assert stats.rounds == 2


def test_no_budget_no_hold_and_the_cap_is_checked() -> None:
    gather = FlowGather(0.2, seated=lambda: 4)
    assert gather.hold(0.0) == 0.0 and gather.stats.holds == 0
    for bad in (0.0, -1.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="a gather holds"):
            FlowGather(bad, seated=lambda: 1)
    for ms in (-1.0, 1000.5, math.nan):
        with pytest.raises(ValueError, match=r"graph_flow_gather_ms must be 0 \(off\) to 1000 ms"):
            SynthesisSettings(graph_flow_gather_ms=ms)


def _speak(eng: CosyVoiceSynthesizer, n: int) -> list[np.ndarray]:
    start = threading.Barrier(n)

    def speak(i: int) -> np.ndarray:
        start.wait()
        request = SynthesisRequest(text=f"Stream number {i} says quite a few words here, one after another.",
                                   seed=i, stream=True)
        return np.concatenate([c.pcm for c in eng.synthesize(request)])

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(speak, range(n), timeout=300))


def test_an_engine_s_streams_gather_their_later_chunks_and_give_the_same_audio(static_flow_bundle: Path) -> None:
    """Two streams on the tiny model's lanes, with graph_flow_gather_ms: later chunks hold (the CPU makes audio
    far ahead of playback), and each stream's audio is what it is without the gather, within the batched
    graphs' tolerance (a held chunk may share a replay it ran alone before)."""
    base = dict(backend="ort", threads=1, overlap_stages=False, graph_flow=True, graph_encoder=False,
                graph_flow_batch=True, graph_flow_overflow_slots=0)
    eng = load_synthesizer(static_flow_bundle, "ort", SynthesisSettings(**base))
    try:
        assert eng.graphs.flow_gather is None
        stats = eng.graphs.flow_batch_stats()
        assert stats is not None and "gather_holds" not in stats
        without = _speak(eng, 2)
    finally:
        eng.close()
    eng = load_synthesizer(static_flow_bundle, "ort", SynthesisSettings(**base, graph_flow_gather_ms=300.0))
    try:
        gather = eng.graphs.flow_gather
        assert gather is not None and gather.max_hold_s == pytest.approx(0.3)
        got = _speak(eng, 2)
        stats = eng.graphs.flow_batch_stats()
        assert stats is not None
        assert int(str(stats["gather_holds"])) >= 1 and int(str(stats["gather_rounds"])) >= 1
        assert float(str(stats["gather_held_ms"])) > 0
    finally:
        eng.close()
    for a, b in zip(got, without, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
