"""The GPU flow's stream seats (models/batching/seats.py): a stream beyond the batched lanes and the
single-stream slots waits for one to end instead of taking the dynamic graph (which ran an H100 out
of memory at sixteen streams, twenty-third run); the seat goes back when the stream closes, also when
its caches could not be made."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.backends.fixed_shapes import OVERFLOW_FLOW_SLOTS
from cosyedge_models.backends.flow_cache import HostStepCache
from cosyedge_models.batching.seats import StreamSeats
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.flow import FlowDecoder
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer
from cosyedge_models.synthesis.voice_cache import FlowPrefix


def test_a_stream_beyond_the_seats_waits_for_one_to_be_given_back() -> None:
    seats = StreamSeats(2, wait_s=10.0)
    assert seats.take() and seats.take() and seats.free == 0
    seated = threading.Event()
    waiter = threading.Thread(target=lambda: seats.take() and seated.set())
    waiter.start()
    assert not seated.wait(0.3)  # every seat is taken: it waits
    seats.give_back()
    assert seated.wait(5.0)
    waiter.join()
    assert seats.free == 0
    report = seats.report()
    assert report["seats"] == 2 and report["seat_waits"] == 1 and report["unseated"] == 0
    assert float(str(report["seat_wait_ms"])) >= 250


def test_a_stream_that_waits_in_vain_goes_on_without_a_seat() -> None:
    seats = StreamSeats(1, wait_s=0.2)
    assert seats.take()
    t0 = time.perf_counter()
    assert seats.take() is False  # the old behaviour after the bound: the dynamic graph
    assert 0.15 <= time.perf_counter() - t0 < 5
    assert seats.report()["unseated"] == 1 and seats.free == 0
    seats.give_back()
    with pytest.raises(RuntimeError, match="without a seat"):
        seats.give_back()
    with pytest.raises(ValueError, match="at least one seat"):
        StreamSeats(0)


def _decoder(engine: CosyVoiceSynthesizer, seats: StreamSeats) -> FlowDecoder:
    return FlowDecoder(engine.bundle, engine.flow.encoder, engine.flow.estimator, HostStepCache, seats=seats)


def test_a_flow_stream_holds_its_seat_until_closed(engine: CosyVoiceSynthesizer) -> None:
    seats = StreamSeats(1, wait_s=10.0)
    decoder = _decoder(engine, seats)
    voice = engine.conditioning.build(SynthesisRequest(text="x")).flow
    first = decoder.stream(voice, "cached")
    assert seats.free == 0
    opened = threading.Event()
    streams = []
    second = threading.Thread(target=lambda: (streams.append(decoder.stream(voice, "cached")), opened.set()))
    second.start()
    assert not opened.wait(0.3)  # its caches wait for the first stream's seat
    first.close()
    assert opened.wait(5.0)
    second.join()
    tokens = np.arange(40) % engine.bundle.llm.speech_token_size
    with streams[0] as stream:
        assert stream.push(tokens).shape[2] > 0  # a seated stream serves as before
    assert seats.free == 1
    first.close()  # idempotent: the seat is not given back twice
    assert seats.free == 1


def test_a_stream_whose_caches_fail_gives_its_seat_back(engine: CosyVoiceSynthesizer) -> None:
    seats = StreamSeats(1, wait_s=0.1)
    decoder = _decoder(engine, seats)
    voice = engine.conditioning.build(SynthesisRequest(text="x")).flow
    prefix = FlowPrefix(committed=0, encoder=None, step_kv=(), step_conv=())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="full left context"):
        decoder.stream(voice, "cached", left_chunks=2, prefix=prefix)
    assert seats.free == 1


def _speak_at_once(eng: CosyVoiceSynthesizer, n: int) -> list[int]:
    """n streams started together; each one's samples (a request's error is raised here)."""
    start = threading.Barrier(n)

    def speak(i: int) -> int:
        start.wait()
        request = SynthesisRequest(text=f"Stream number {i} says a few words here.", seed=i, stream=True)
        return sum(c.pcm.size for c in eng.synthesize(request))

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(speak, range(n), timeout=300))


def test_more_streams_than_seats_all_speak_through_the_engine(static_flow_bundle: Path) -> None:
    """Six streams at once on two lanes and the single-stream slots beside them: the streams beyond
    the seats wait, none takes the dynamic graph for want of a seat, every one gives audio."""
    settings = SynthesisSettings(backend="ort", threads=1, overlap_stages=False, graph_flow=True,
                                 graph_encoder=False, graph_flow_batch=True)
    eng = load_synthesizer(static_flow_bundle, "ort", settings)
    try:
        seats = eng.graphs.flow_seats
        batcher = eng.graphs.flow_batch
        assert seats is not None and batcher is not None
        assert seats.count == batcher.graphs.lanes + OVERFLOW_FLOW_SLOTS
        assert eng.concurrent_streams() == seats.count  # what the daemon's scheduler bounds its local requests by
        n = seats.count + 2
        samples = _speak_at_once(eng, n)
        assert len(samples) == n and min(samples) > 0
        stats = eng.graphs.flow_batch_stats()
        assert stats is not None and stats["unseated"] == 0
        assert int(str(stats["seat_waits"])) >= 1
        assert seats.free == seats.count  # every seat back
    finally:
        eng.close()


def test_an_engine_without_the_lanes_states_no_bound(engine: CosyVoiceSynthesizer) -> None:
    assert engine.graphs.flow_seats is None and engine.concurrent_streams() is None


def test_with_no_overflow_slots_the_seats_are_the_lanes_and_every_stream_takes_one(static_flow_bundle: Path) -> None:
    """graph_flow_overflow_slots = 0: no single-stream fixed-shape slot is made (on an 80 GB card their
    15.2 GB went to the lanes instead: 16 in place of 8), the seats are the lanes, a stream beyond them
    waits for one, and a stream alone gives the audio it gives beside the default overflow slots."""
    with pytest.raises(ValueError, match="graph_flow_overflow_slots must be >= 0 streams"):
        SynthesisSettings(graph_flow_overflow_slots=-1)
    base = dict(backend="ort", threads=1, overlap_stages=False, graph_flow=True, graph_encoder=False,
                graph_flow_batch=True)
    request = SynthesisRequest(text="One stream says a few words here.", seed=3, stream=True)
    eng = load_synthesizer(static_flow_bundle, "ort", SynthesisSettings(**base))
    try:
        assert eng.graphs.flow is not None and eng.graphs.flow.max_slots > 0
        alone_default = np.concatenate([c.pcm for c in eng.synthesize(request)])
    finally:
        eng.close()
    eng = load_synthesizer(static_flow_bundle, "ort", SynthesisSettings(**base, graph_flow_overflow_slots=0))
    try:
        seats, batcher, flow = eng.graphs.flow_seats, eng.graphs.flow_batch, eng.graphs.flow
        assert seats is not None and batcher is not None and flow is not None
        assert flow.max_slots == 0 and flow.slot_count == 0  # the sessions only
        assert seats.count == batcher.graphs.lanes
        np.testing.assert_array_equal(np.concatenate([c.pcm for c in eng.synthesize(request)]), alone_default)
        assert min(_speak_at_once(eng, seats.count + 1)) > 0
        stats = eng.graphs.flow_batch_stats()
        assert stats is not None and stats["fallbacks"] == 0 and stats["unseated"] == 0  # every stream on a lane
        assert int(str(stats["seat_waits"])) >= 1 and seats.free == seats.count
    finally:
        eng.close()
