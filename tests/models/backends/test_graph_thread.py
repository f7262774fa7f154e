"""The GPU graph thread (models/backends/graph_thread.py) and the engine's use
of it: every run of a captured session (the LLM's fixed-size step, the
fixed-shape flow windows) happens on that one thread, warm-up included,
concurrent streams give what serial ones give, errors raised there reach the
caller, and after close() a call says so. On the CPU the sessions run the
same graphs without capture; `-m gpu` runs them with CUDA graphs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from cosyedge_models.backends.graph_thread import GraphPriority, GraphThread, GraphThreadClosed
from cosyedge_models.backends.ort import OrtSession
from cosyedge_models.backends.ort_graph_decode import GraphDecoder
from cosyedge_models.bundle.loader import STATIC_FLOW_PREFIX
from cosyedge_models.synthesis.api import AudioChunk, SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer

from tests.support.components import require_cuda_provider
from tests.support.concurrent import run_concurrently

CAPTURED = ("llm_decode_static", STATIC_FLOW_PREFIX)
# short: prompt + 20 speech tokens a text token must fit the tiny bundle's 256-position fixed-size step
TEXTS = ("Graphs on one thread.", "Eight at once.", "A third voice.", "One, two, three.", "Fifth request.",
         "Six is last.")


# --- the worker alone ----------------------------------------------------------------------
def test_work_runs_on_the_worker_and_each_caller_gets_its_result() -> None:
    with GraphThread() as worker:
        seen: dict[int, list[tuple[int, int]]] = {}

        def caller(i: int) -> None:
            seen[i] = [worker.call(lambda j=j: (threading.get_ident(), i * 1000 + j)) for j in range(50)]

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert sorted(seen) == list(range(8))
    for i, results in seen.items():
        assert [r for _, r in results] == [i * 1000 + j for j in range(50)]  # its own results, in its order
        assert {tid for tid, _ in results} == {worker.ident}
    assert worker.ident != threading.get_ident() and worker.calls == 400


def test_an_exception_in_the_work_reaches_the_caller_and_the_worker_goes_on() -> None:
    class Refused(RuntimeError):
        pass

    def fail() -> int:
        raise Refused(f"refused on {threading.get_ident()}")

    with GraphThread() as worker:
        with pytest.raises(Refused, match=f"refused on {worker.ident}"):
            worker.call(fail)
        assert worker.call(lambda: 7) == 7
        # work that calls back into the worker runs inline instead of waiting on itself
        assert worker.call(lambda: worker.call(lambda: threading.get_ident())) == worker.ident


def test_the_worker_counts_its_busy_time_by_the_label_of_the_work() -> None:
    with GraphThread() as worker:
        worker.call(lambda: time.sleep(0.05), label="replay")
        worker.call(lambda: time.sleep(0.02))  # unlabelled: its priority's name
        with pytest.raises(ZeroDivisionError):
            worker.call(lambda: (time.sleep(0.01), 1 / 0), label="replay")  # failed work counts too
        busy = worker.order_stats()["busy_ms"]
    assert isinstance(busy, dict) and set(busy) == {"replay", "normal"}
    assert 60 <= busy["replay"] < 1000 and 20 <= busy["normal"] < 1000


def test_the_worker_counts_how_long_work_waited_in_its_queue_by_label() -> None:
    """waited_ms: from submission until the worker took it (an LLM step behind a flow replay waits for it)."""
    with GraphThread() as worker:
        started = threading.Event()
        first = worker.submit(lambda: (started.set(), time.sleep(0.08)), label="replay")
        assert started.wait(10)
        worker.submit(lambda: None, GraphPriority.LLM, label="step").result(10)  # queued behind the replay
        first.result(10)
        stats = worker.order_stats()
    waited, busy = stats["waited_ms"], stats["busy_ms"]
    assert isinstance(waited, dict) and isinstance(busy, dict) and set(waited) == {"replay", "step"}
    assert 50 <= waited["step"] <= busy["replay"] + 50  # most of the replay's 80 ms, never much more
    assert waited["replay"] < 50  # an idle worker took it at once


def test_close_runs_what_is_queued_then_refuses_with_a_clear_error() -> None:
    worker = GraphThread(max_pending=2)
    with pytest.raises(GraphThreadClosed, match="not started"):
        worker.call(lambda: 1)
    worker.start()
    gate = threading.Event()
    blocked = worker.submit(gate.wait)
    queued = [worker.submit(lambda i=i: i) for i in range(2)]  # the queue is full now
    late: list[int] = []
    submitter = threading.Thread(target=lambda: late.append(worker.call(lambda: 99)))
    submitter.start()
    time.sleep(0.3)
    assert submitter.is_alive() and not late  # bounded: the submit waits for room
    gate.set()
    submitter.join(10)
    assert late == [99] and blocked.result() is True and [f.result() for f in queued] == [0, 1]
    worker.close()
    worker.close()  # idempotent
    assert not worker.alive
    with pytest.raises(GraphThreadClosed, match="closed"):
        worker.call(lambda: 1)
    with pytest.raises(GraphThreadClosed):
        worker.start()


# --- the engine ----------------------------------------------------------------------------
def _engine(bundle: Path, slots: int = 8) -> CosyVoiceSynthesizer:
    # overlap on: the LLM decodes on producer threads, flow + vocoder on the request threads
    return load_synthesizer(bundle, settings=SynthesisSettings(
        threads=1, overlap_stages=True, graph_flow=True, graph_decode=True, graph_flow_slots=slots,
        graph_decode_slots=slots))


def _request(i: int) -> SynthesisRequest:
    return SynthesisRequest(text=TEXTS[i % len(TEXTS)], seed=100 + i, stream=True)


def _synthesize(engine: CosyVoiceSynthesizer, i: int) -> np.ndarray:
    return np.concatenate([c.pcm for c in engine.synthesize(_request(i))])


def _concurrently(engine: CosyVoiceSynthesizer, n: int) -> dict[int, np.ndarray]:
    return run_concurrently(n, lambda i: _synthesize(engine, i))


@pytest.fixture()
def recorded_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """(session name, thread id) of every run of a captured session, through OrtSession itself."""
    runs: list[tuple[str, int]] = []
    real_bound, real_run = OrtSession.run_bound, OrtSession.run

    def run_bound(self: OrtSession, binding: ort.IOBinding, options: ort.RunOptions | None = None) -> None:
        if self.name.startswith(CAPTURED):
            runs.append((self.name, threading.get_ident()))
        real_bound(self, binding, options)

    def run(self: OrtSession, inputs: dict[str, np.ndarray], outputs: list[str] | None = None
            ) -> dict[str, np.ndarray]:
        if self.name.startswith(CAPTURED):
            runs.append((self.name, threading.get_ident()))
        return real_run(self, inputs, outputs)

    monkeypatch.setattr(OrtSession, "run_bound", run_bound)
    monkeypatch.setattr(OrtSession, "run", run)
    yield runs


def test_every_run_of_a_captured_session_is_on_the_graph_thread(graph_bundle: Path,
                                                                  recorded_runs: list[tuple[str, int]]) -> None:
    engine = _engine(graph_bundle, slots=4)
    try:
        assert engine.graphs.thread is not None and engine.static_flow is not None
        assert isinstance(engine.lm.fixed_size_decode, GraphDecoder)
        warm = len(recorded_runs)
        windows = len(engine.static_flow.windows)
        # warm-up at load: every slot's graphs (4 decode slots x 2 directions; 4 x n_timesteps flow slots x windows)
        assert warm == 4 * 2 + 4 * engine.bundle.flow.n_timesteps * windows
        outs = _concurrently(engine, 4)
        assert all(o.size for o in outs.values())
        names = {name for name, _ in recorded_runs[warm:]}
        assert "llm_decode_static" in names and any(n.startswith(STATIC_FLOW_PREFIX) for n in names)
        assert {tid for _, tid in recorded_runs} == {engine.graphs.thread.ident}
        assert engine.static_flow.replays > 0 and engine.static_flow.disabled is None
    finally:
        engine.close()
    assert engine.graphs.thread is not None and not engine.graphs.thread.alive


def test_per_stage_threads_keep_each_stage_on_its_own_thread(graph_bundle: Path,
                                                              recorded_runs: list[tuple[str, int]]) -> None:
    """graph_threads="per-stage": the LLM step, the flow windows and the vocoder graphs each
    replay on their own thread (warm-up included), with the audio of the one-thread engine; the
    first chunks' holds are opened on the flow and vocoder threads, never on the LLM's (nothing
    there to put first: it would only stall the other streams' tokens)."""
    outs = {}
    for mode in ("one", "per-stage"):
        recorded_runs.clear()
        engine = load_synthesizer(graph_bundle, settings=SynthesisSettings(
            threads=1, overlap_stages=True, graph_flow=True, graph_decode=True, graph_vocoder=True,
            graph_flow_slots=4, graph_decode_slots=4, graph_threads=mode))
        try:
            threads = dict(engine.graphs.threads)
            assert set(threads) == {"decode", "flow", "vocoder"}
            vocoder_calls = engine.static_vocoder.replays if engine.static_vocoder else -1
            outs[mode] = _concurrently(engine, 3)
            assert engine.static_vocoder is not None and engine.static_vocoder.replays > vocoder_calls
            by_stage = {("decode" if name == "llm_decode_static" else "flow"): tid for name, tid in recorded_runs}
            holds = {stage: t.order_stats()["holds"] for stage, t in threads.items()}
            if mode == "one":
                assert engine.graphs.thread is not None and len({id(t) for t in threads.values()}) == 1
                assert set(by_stage.values()) == {engine.graphs.thread.ident}
                assert holds["decode"] == 3  # each streaming request's first chunk, on the one thread
            else:
                assert engine.graphs.thread is None and len({t.ident for t in threads.values()}) == 3
                assert holds == {"decode": 0, "flow": 3, "vocoder": 3}, holds
                assert engine.graphs.first_audio_threads() == [threads["flow"], threads["vocoder"]]
                for name, tid in recorded_runs:
                    stage = "decode" if name == "llm_decode_static" else "flow"
                    assert tid == threads[stage].ident, name
        finally:
            engine.close()
        assert not any(t.alive for t in threads.values())
    for i, audio in outs["one"].items():
        np.testing.assert_allclose(outs["per-stage"][i], audio, atol=1e-5)


def test_concurrent_streams_match_serial_runs(graph_bundle: Path) -> None:
    engine = _engine(graph_bundle)
    try:
        serial = {i: _synthesize(engine, i) for i in range(6)}
        concurrent = _concurrently(engine, 6)
    finally:
        engine.close()
    for i in range(6):
        assert concurrent[i].shape == serial[i].shape and serial[i].size > 0
        np.testing.assert_allclose(concurrent[i], serial[i], rtol=0, atol=1e-6)


def test_after_close_a_captured_call_raises_a_clear_error(graph_bundle: Path) -> None:
    engine = _engine(graph_bundle, slots=1)
    decoder = engine.lm.fixed_size_decode
    graphs = engine.static_flow
    assert isinstance(decoder, GraphDecoder) and graphs is not None
    loop = decoder.loop(32)
    assert loop is not None
    hidden = engine.bundle.llm.hidden_size
    loop.prefill(np.zeros((1, 4, hidden), np.float32))
    cache = graphs(engine.flow.estimator, engine.flow.cache_spec())
    engine.close()
    with pytest.raises(GraphThreadClosed, match="GPU graph thread is closed"):
        loop.step(np.zeros((1, 1, hidden), np.float32))
    shapes = graphs.io[0].session.input_shapes  # a 10-frame window of the smallest graph's inputs
    feeds = {n: np.zeros((*shapes[n][:-1], 10) if n in ("x", "mask", "mu", "cond") else shapes[n], np.float32)
             for n in ("x", "mask", "mu", "t", "spks", "cond")}
    with pytest.raises(GraphThreadClosed, match="GPU graph thread is closed"):
        cache.run(feeds, 10)
    cache.close()
    loop.close()


def test_a_capture_refused_at_load_leaves_the_engine_on_the_dynamic_graphs(graph_bundle: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that fails at load (on a GPU: an op onnxruntime cannot capture,
    or another engine's CUDA work meanwhile) disables that stage's graphs; the
    engine loads and speaks as without them."""
    from cosyedge_models.errors import SynthesisError

    real = OrtSession.run_bound
    where: list[int] = []

    def refuse(self: OrtSession, binding: ort.IOBinding, options: ort.RunOptions | None = None) -> None:
        if self.name.startswith(CAPTURED):
            where.append(threading.get_ident())
            raise SynthesisError(f"{self.name}: capture refused (test)")
        real(self, binding, options)

    monkeypatch.setattr(OrtSession, "run_bound", refuse)
    engine = _engine(graph_bundle, slots=2)
    try:
        decoder, graphs = engine.lm.fixed_size_decode, engine.static_flow
        assert isinstance(decoder, GraphDecoder) and graphs is not None and engine.graphs.thread is not None
        assert decoder.disabled is not None and "capture refused" in decoder.disabled
        assert graphs.disabled is not None and "capture refused" in graphs.disabled
        assert set(where) == {engine.graphs.thread.ident} and len(where) == 2  # one refusal each, then stopped
        calls = len(where)
        assert decoder.loop(32) is None
        assert _synthesize(engine, 0).size > 0
        assert len(where) == calls  # the captured sessions are not run again
    finally:
        engine.close()


@pytest.mark.gpu
def test_eight_streams_with_cuda_graphs_match_serial_runs(graph_bundle: Path,
                                                         recorded_runs: list[tuple[str, int]]) -> None:
    """On a GPU: both graph stages captured at load on the graph thread, then
    8 streams at once through them (LLM steps from 8 producer threads, flow
    windows from 8 request threads, other sessions' copies meanwhile), each
    equal to its serial run, without a fallback to the dynamic graphs."""
    require_cuda_provider()
    engine = load_synthesizer(graph_bundle, settings=SynthesisSettings(
        backend="ort-cuda", graph_flow=True, graph_flow_slots=8, graph_decode_slots=8))
    try:
        graphs, decoder, worker = engine.static_flow, engine.lm.fixed_size_decode, engine.graphs.thread
        assert graphs is not None and isinstance(decoder, GraphDecoder) and worker is not None
        assert graphs.capture and decoder.capture and engine.overlap  # graph_decode and overlap: auto on ort-cuda
        assert graphs.disabled is None, graphs.disabled  # every capture at load succeeded
        serial = {i: _synthesize(engine, i) for i in range(8)}
        replays = graphs.replays
        concurrent = _concurrently(engine, 8)
        assert graphs.disabled is None, graphs.disabled  # no replay refused under concurrency
        assert graphs.replays > replays
        assert {tid for _, tid in recorded_runs} == {worker.ident}
    finally:
        engine.close()
    for i in range(8):
        assert concurrent[i].shape == serial[i].shape and serial[i].size > 0
        np.testing.assert_allclose(concurrent[i], serial[i], rtol=0, atol=1e-4)


def test_a_streams_first_chunk_holds_the_llm_steps_on_the_graph_thread(graph_bundle: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The first chunk first (graph_thread.py's GraphWorkOrder): each request opens one
    first-audio hold, around its first chunk's flow and vocoder, recorded in its timeline;
    every LLM step reaches the graph thread tagged LLM (so a hold keeps it waiting)."""
    from cosyedge_models.backends import ort_graph_decode

    steps: list[int] = []
    real_replay = ort_graph_decode._replay

    def replay(*args: object) -> np.ndarray:
        steps.append(threading.get_ident())
        return real_replay(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(ort_graph_decode, "_replay", replay)
    engine = _engine(graph_bundle, slots=4)
    worker = engine.graphs.thread
    assert worker is not None and engine.graphs.holds_first_audio
    worker.order.hold_max_s = 3600.0  # no expiry on a loaded CI machine: the order is exact
    worker.order.max_overtakes = 1 << 30
    chunks: dict[int, list[AudioChunk]] = {}
    try:
        before = worker.order_stats()
        start = threading.Barrier(2)

        def one(i: int) -> None:
            start.wait()
            chunks[i] = list(engine.synthesize(_request(i)))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        by_thread = engine.graphs.order_stats()
        assert list(by_thread) == ["decode+flow"]  # one graph thread for both stages
        stats = by_thread["decode+flow"]
    finally:
        engine.close()
    assert before["holds"] == 0 and before["runs"]["llm"] == 0  # warm-up is NORMAL work
    assert sorted(chunks) == [0, 1]
    assert stats["holds"] == 2 and stats["forced"] == 0 and stats["expired"] == 0
    runs = stats["runs"]
    assert isinstance(runs, dict) and runs["llm"] == len(steps) > 0 and runs["first_audio"] > 0
    assert set(steps) == {worker.ident}
    for out in chunks.values():
        assert len(out) >= 2 and out[0].pcm.size > 0
        events = out[-1].times.timeline
        holds = [e for e in events if e.stage == "hold"]
        assert len(holds) == 1 and holds[0].chunk == 0
        first = [e for e in events if e.chunk == 0 and e.stage in ("flow", "vocoder")]
        assert {e.stage for e in first} == {"flow", "vocoder"}
        assert all(holds[0].start_ms <= e.start_ms and e.end_ms <= holds[0].end_ms for e in first)


def _first_chunk_probe(graph_bundle: Path, monkeypatch: pytest.MonkeyPatch, settings: SynthesisSettings,
                       steps_run: Callable[[CosyVoiceSynthesizer], int]
                       ) -> tuple[dict[str, int], list[AudioChunk], dict[str, object], CosyVoiceSynthesizer]:
    """One seeded request on an engine of `settings`; inside its first chunk's hold, once the LLM's next
    step is queued on the graph thread: the LLM items queued and `steps_run(engine)` before and after
    the chunk's flow. Returns them, the chunks, the graph thread's order stats and the (closed) engine."""
    from cosyedge_models.backends.graph_thread import GraphPriority

    seen: dict[str, int] = {}
    real_flow = CosyVoiceSynthesizer._flow_stream

    def flow_stream(self: CosyVoiceSynthesizer, flow: object, tokens: list[int], state: object, final: bool,
                    prime: bool = False) -> np.ndarray:
        worker = self.graphs.thread
        if not prime and not seen and worker is not None:  # the first chunk, inside its hold
            deadline = time.monotonic() + 120
            while worker.pending(GraphPriority.LLM) == 0 and time.monotonic() < deadline:
                time.sleep(0.005)  # the LLM decodes on: its next step reaches the queue
            seen["queued"], seen["ran_before"] = worker.pending(GraphPriority.LLM), steps_run(self)
            mel = real_flow(self, flow, tokens, state, final)  # type: ignore[arg-type]
            seen["queued_after"], seen["ran_after"] = worker.pending(GraphPriority.LLM), steps_run(self)
            return mel
        return real_flow(self, flow, tokens, state, final, prime)  # type: ignore[arg-type]

    monkeypatch.setattr(CosyVoiceSynthesizer, "_flow_stream", flow_stream)
    engine = load_synthesizer(graph_bundle, settings=settings)
    try:
        assert engine.graphs.thread is not None
        engine.graphs.thread.order.hold_max_s = 3600.0
        engine.graphs.thread.order.max_overtakes = 1 << 30
        chunks = list(engine.synthesize(_request(1)))
        stats = engine.graphs.thread.order_stats()
    finally:
        engine.close()
    return seen, chunks, stats, engine


def test_the_llm_producers_next_step_waits_for_the_first_chunk(graph_bundle: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The gating through the real pipeline: while the first chunk's flow and vocoder run,
    the LLM producer's next decode step is queued on the graph thread and does not run."""
    from cosyedge_models.backends import ort_graph_decode

    llm_runs: list[int] = []
    real_replay = ort_graph_decode._replay

    def replay(*args: object) -> np.ndarray:
        llm_runs.append(1)
        return real_replay(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(ort_graph_decode, "_replay", replay)
    seen, chunks, stats, _ = _first_chunk_probe(graph_bundle, monkeypatch, SynthesisSettings(
        threads=1, overlap_stages=True, graph_flow=True, graph_decode=True, graph_flow_slots=2,
        graph_decode_slots=2, overlap_queue_tokens=1024), lambda _engine: len(llm_runs))
    assert len(chunks) >= 2
    # (a seeded request: the LLM has tokens left after the first chunk, so its next step comes)
    assert seen["queued"] == 1 and seen["ran_before"] > 0
    assert seen["queued_after"] == 1 and seen["ran_after"] == seen["ran_before"]  # held through the flow
    assert isinstance(stats["deferred"], int) and stats["deferred"] >= 1 and stats["holds"] == 1


def test_the_batched_llm_steps_wait_for_a_streams_first_chunk(graph_bundle: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """graph_batching: the batcher's steps (every running stream's tokens in one replay) reach the
    graph thread tagged LLM once the stream's first chunk has its tokens, so that chunk holds them as it
    holds the single-stream steps: while its flow runs a step is queued and none runs."""
    from cosyedge_models.batching.graph_batcher import GraphBatcher
    from cosyedge_models.batching.policy import BatchSettings

    def batched_steps(engine: CosyVoiceSynthesizer) -> int:
        assert isinstance(engine.batcher, GraphBatcher)
        return engine.batcher.stats.steps

    seen, chunks, stats, engine = _first_chunk_probe(graph_bundle, monkeypatch, SynthesisSettings(
        threads=1, overlap_stages=True, graph_flow=True, graph_decode=True, graph_flow_slots=2,
        graph_decode_slots=2, graph_batching=True, batching=BatchSettings(max_batch_size=2),
        overlap_queue_tokens=1024), batched_steps)
    assert isinstance(engine.batcher, GraphBatcher)
    assert len(chunks) >= 2
    assert seen["queued"] == 1 and seen["ran_before"] > 0
    assert seen["queued_after"] == 1 and seen["ran_after"] == seen["ran_before"]  # held through the flow
    runs = stats["runs"]
    assert isinstance(runs, dict) and runs["llm"] > 0 and stats["holds"] == 1
    assert isinstance(stats["busy_ms"], dict) and stats["busy_ms"]["llm_batched_step"] > 0
