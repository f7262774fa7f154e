"""The iteration-level batcher of the fixed-shape LLM path on the tiny bundle
(models/batching/graph_batcher.py over LoopedGraphStep, the per-stream
fixed-size step, without capture on the CPU): seeded streams that join and
leave at chosen steps give exactly the tokens they give alone; the steps run
on the engine's graph thread, padded to the captured sizes; a running stream
waits for at most max_prefills_between_steps prefills between two steps
(counted from the calls the step received)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cosyedge_models.backends.graph_thread import GraphPriority, GraphThread
from cosyedge_models.backends.ort_graph_decode import GraphDecoder
from cosyedge_models.batching.graph_batcher import GraphBatcher
from cosyedge_models.batching.iteration import IterationSettings
from cosyedge_models.batching.llm_batcher import TokenStream
from cosyedge_models.batching.looped_step import LoopedGraphStep
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.errors import SynthesisError
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.llm import LlmInput, SpeechTokenLM
from cosyedge_models.synthesis.sampling import TokenSampler
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer

from tests.support.components import require_cuda_provider

TEXTS = ["Hello world one two.", "A quick fox", "A", "Numbers today", "Dates and times"]


@pytest.fixture(scope="module")
def static_engine(tiny_static_bundle: Path) -> Iterator[CosyVoiceSynthesizer]:
    eng = load_synthesizer(tiny_static_bundle, settings=SynthesisSettings(threads=1, graph_decode=True,
                                                                          graph_decode_slots=4))
    yield eng
    eng.close()


def _decoder(lm: SpeechTokenLM) -> GraphDecoder:
    assert isinstance(lm.fixed_size_decode, GraphDecoder)
    return lm.fixed_size_decode


def _input(eng: CosyVoiceSynthesizer, i: int) -> LlmInput:
    return LlmInput(text=eng.tokenizer.encode(TEXTS[i]))


def _sampler(lm: SpeechTokenLM, seed: int) -> TokenSampler:
    return TokenSampler.seeded(lm.config.sampling, lm.config.eos_token, seed)


class Recorder:
    """A BatchedDecodeStep around another that records its calls (and where they ran)."""

    def __init__(self, inner: LoopedGraphStep, thread_ident: int | None) -> None:
        self.inner = inner
        self.events: list[tuple] = []
        self.thread_ident = thread_ident
        self.off_thread_steps = 0
        self.batch_sizes = inner.batch_sizes
        self.rows = inner.rows
        self.positions = inner.positions
        self.takes_past = inner.takes_past
        self.captured_prefill = inner.captured_prefill

    def prefill(self, row: int, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        self.events.append(("prefill", row))
        return self.inner.prefill(row, inputs_embeds, past)

    def step(self, rows: Sequence[int], inputs_embeds: np.ndarray, lengths: Sequence[int],
             batch_size: int) -> np.ndarray:
        self.off_thread_steps += threading.get_ident() != self.thread_ident
        self.events.append(("step", tuple(rows), batch_size))
        return self.inner.step(rows, inputs_embeds, lengths, batch_size)


def _batcher(eng: CosyVoiceSynthesizer, bound: int, rows: int = 4,
             first_chunk_priority: GraphPriority = GraphPriority.NORMAL) -> tuple[GraphBatcher, Recorder]:
    dec = _decoder(eng.lm)
    rec = Recorder(LoopedGraphStep(dec, rows), dec.thread.ident)
    settings = IterationSettings(BatchSettings(max_batch_size=rows), rec.batch_sizes, rows, bound)
    return GraphBatcher(eng.lm, rec, dec.thread, settings, first_chunk_priority=first_chunk_priority), rec


def _drive(eng: CosyVoiceSynthesizer, b: GraphBatcher, joins: dict[int, list[tuple[int, int]]]
           ) -> dict[int, TokenStream]:
    """Submit (text, seed) pairs before round r; rounds until everything is done."""
    streams: dict[int, TokenStream] = {}
    r = 0
    while r <= max(joins) or b.active or b.waiting:
        for i, seed in joins.get(r, ()):
            streams[seed] = b.submit(_input(eng, i), _sampler(b.lm, seed))
        b.run_once()
        r += 1
    return streams


@pytest.mark.parametrize(("joins", "bound"), [
    ({0: [(0, 11)], 2: [(1, 12)], 5: [(2, 13), (3, 14)], 6: [(4, 15)]}, 1),
    ({0: [(1, 21), (3, 22), (0, 23)], 1: [(4, 24)], 9: [(2, 25)]}, 2),
])
def test_streams_joining_and_leaving_give_their_tokens_alone(static_engine: CosyVoiceSynthesizer,
                                                             joins: dict[int, list[tuple[int, int]]],
                                                             bound: int) -> None:
    lm = static_engine.lm
    alone = {seed: list(lm.generate(_input(static_engine, i), _sampler(lm, seed)))
             for group in joins.values() for i, seed in group}
    assert all(alone.values()) and len({tuple(t) for t in alone.values()}) == len(alone)  # distinct, non-empty
    b, rec = _batcher(static_engine, bound)
    try:
        streams = _drive(static_engine, b, joins)
    finally:
        rec.inner.close()
    assert {seed: list(s) for seed, s in streams.items()} == alone
    steps = [e for e in rec.events if e[0] == "step"]
    assert rec.off_thread_steps == 0 and b.stats.shared_steps > 0
    assert all(e[2] in rec.batch_sizes and len(e[1]) <= e[2] for e in steps)
    assert any(e[2] > len(e[1]) for e in steps)  # some batch was padded (3 rows run as 4)
    # The prefill bound: between two steps, at most `bound` prefills while streams run.
    since, worst, running = 0, 0, False
    for e in rec.events:
        if e[0] == "prefill":
            since += 1
            worst = max(worst, since) if running else worst
        else:
            since, running = 0, True
    assert 0 < worst <= bound


def test_a_cancelled_stream_leaves_and_its_row_is_reused(static_engine: CosyVoiceSynthesizer) -> None:
    lm = static_engine.lm
    want = list(lm.generate(_input(static_engine, 0), _sampler(lm, 31)))
    later = list(lm.generate(_input(static_engine, 1), _sampler(lm, 33)))
    b, rec = _batcher(static_engine, bound=1, rows=2)
    try:
        keep = b.submit(_input(static_engine, 0), _sampler(lm, 31))
        cancel = threading.Event()
        gone = b.submit(_input(static_engine, 3), _sampler(lm, 32), cancel=cancel)
        for _ in range(3):
            b.run_once()
        cancel.set()
        b.run_once()
        assert b.active == 1
        newcomer = b.submit(_input(static_engine, 1), _sampler(lm, 33))
        while b.active or b.waiting:
            b.run_once()
    finally:
        rec.inner.close()
    assert list(keep) == want and list(newcomer) == later
    assert len(list(gone)) <= 3
    assert [e[1] for e in rec.events if e[0] == "prefill"] == [0, 1, 1]  # the freed row 1 again


def test_a_stream_whose_sampling_fails_in_a_shared_step_fails_alone(static_engine: CosyVoiceSynthesizer) -> None:
    """Greedy sampling whose 'EOS' is the token it must draw at its second step, while EOS is still held
    back: that stream's sampling gives up in a step it shares; it ends with the error, the other stream
    gives its tokens alone."""
    lm = static_engine.lm
    greedy = dataclasses.replace(lm.config.sampling, top_k=1, tau_r=2.0)  # never more repeats than the window
    first_two = list(lm.generate(_input(static_engine, 1), TokenSampler.seeded(greedy, lm.config.eos_token, 0)))[:2]
    assert len(first_two) == 2 and _input(static_engine, 1).length_limits(lm.config)[0] >= 2
    want = list(lm.generate(_input(static_engine, 3), _sampler(lm, 51)))
    b, rec = _batcher(static_engine, bound=2, rows=2)
    try:
        failing = b.submit(_input(static_engine, 1), TokenSampler.seeded(greedy, first_two[1], 0))
        keep = b.submit(_input(static_engine, 3), _sampler(lm, 51))
        while b.active or b.waiting:
            b.run_once()
    finally:
        rec.inner.close()
    assert list(keep) == want
    got: list[int] = []
    with pytest.raises(SynthesisError, match="LLM sampling failed: sampling drew EOS 100 times"):
        got.extend(failing)
    assert got == first_two[:1]
    assert [e[1] for e in rec.events if e[0] == "step"][0] == (0, 1)  # the failing step was shared


def test_worker_thread_serves_concurrent_streams(static_engine: CosyVoiceSynthesizer) -> None:
    lm = static_engine.lm
    alone = {i: list(lm.generate(_input(static_engine, i), _sampler(lm, 40 + i))) for i in range(4)}
    b, rec = _batcher(static_engine, bound=1)
    got: dict[int, list[int]] = {}
    try:
        with b:
            def run(i: int) -> None:
                got[i] = list(b.generate(_input(static_engine, i), _sampler(lm, 40 + i)))
            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
    finally:
        rec.inner.close()
    assert got == alone


class ConcurrentPrefills(Recorder):
    """A Recorder whose first `parties` prefills only return together: they must run at once."""

    def __init__(self, inner: LoopedGraphStep, thread_ident: int | None, parties: int) -> None:
        super().__init__(inner, thread_ident)
        self.barrier = threading.Barrier(parties, timeout=30)
        self.prefill_threads: set[str] = set()

    def prefill(self, row: int, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        self.prefill_threads.add(threading.current_thread().name)
        if len(self.prefill_threads) <= self.barrier.parties and not self.barrier.broken:
            self.barrier.wait()  # BrokenBarrierError after 30 s: the prefills ran one after another
        return super().prefill(row, inputs_embeds, past)


def test_a_rounds_prefills_run_at_once_on_the_prefill_threads(static_engine: CosyVoiceSynthesizer) -> None:
    """[tts] llm_parallel_prefills: a round's prefills run on that many threads at once (each writes its own
    row), the step waits for them all, and every stream gives the tokens it gives alone."""
    lm = static_engine.lm
    alone = {i: list(lm.generate(_input(static_engine, i), _sampler(lm, 60 + i))) for i in range(3)}
    dec = _decoder(lm)
    rec = ConcurrentPrefills(LoopedGraphStep(dec, 4), dec.thread.ident, parties=3)
    settings = IterationSettings(BatchSettings(max_batch_size=4), rec.batch_sizes, 4, 3)
    b = GraphBatcher(lm, rec, dec.thread, settings, prefill_threads=3)
    try:
        streams = {i: b.submit(_input(static_engine, i), _sampler(lm, 60 + i)) for i in range(3)}
        b.run_once()  # the three prefills (at once), then the first step of all three
        assert [e[0] for e in rec.events].count("prefill") == 3 and rec.events[-1] == ("step", (0, 1, 2), 4)
        while b.active or b.waiting:
            b.run_once()
        b.stop()  # the prefill threads end with the worker
    finally:
        rec.inner.close()
    assert {i: list(s) for i, s in streams.items()} == alone
    assert len(rec.prefill_threads) == 3 and all(n.startswith("llm-prefill") for n in rec.prefill_threads)
    # where the batcher's time went (bench's llm_prefill_ms, llm_step_call_ms, llm_step_host_ms)
    assert b.stats.prefill_s > 0 and b.stats.step_call_s > 0 and b.stats.step_host_s > 0
    assert not any(t.name.startswith("llm-prefill") for t in threading.enumerate())
    with pytest.raises(ValueError, match="prefill_threads must be >= 1, got 0"):
        GraphBatcher(lm, rec, dec.thread, settings, prefill_threads=0)


def test_a_request_that_does_not_fit_runs_alone_on_the_ordinary_loop(static_engine: CosyVoiceSynthesizer) -> None:
    lm = static_engine.lm
    long = LlmInput(text=[5] * 200)  # prompt + most speech tokens beyond the step's positions
    alone = list(lm.generate(long, _sampler(lm, 1)))
    b, rec = _batcher(static_engine, bound=1, rows=1)
    try:
        with pytest.raises(SynthesisError, match="does not fit"):
            b.submit(long, _sampler(lm, 1))  # the batched step itself refuses it
        assert list(b.generate(long, _sampler(lm, 1))) == alone  # generate() routes it around the batch
        assert b.stats.unbatched == 1 and rec.events == []  # nothing ran on the batched step
        with pytest.raises(SynthesisError, match="free slots"):
            LoopedGraphStep(_decoder(static_engine.lm), 4)  # one of the four is borrowed
    finally:
        rec.inner.close()


def test_engine_with_graph_batching_gives_the_same_audio(static_engine: CosyVoiceSynthesizer,
                                                         tiny_static_bundle: Path) -> None:
    chunks: list[int] = []

    def audio(eng: CosyVoiceSynthesizer, seed: int) -> np.ndarray:
        pcm = [c.pcm for c in eng.synthesize(SynthesisRequest(text=TEXTS[0], seed=seed))]
        chunks.append(len(pcm))
        return np.concatenate(pcm)

    plain = {seed: audio(static_engine, seed) for seed in (3, 5)}
    settings = SynthesisSettings(threads=1, graph_decode=True, graph_decode_slots=2, graph_batching=True,
                                 batching=BatchSettings(max_batch_size=8))  # lowered to the 2 slots
    batched = load_synthesizer(tiny_static_bundle, settings=settings)
    results: dict[int, np.ndarray] = {}
    try:
        assert isinstance(batched.batcher, GraphBatcher)
        assert batched.batcher.scheduler.settings.batch.max_batch_size == 2
        threads = [threading.Thread(target=lambda s=seed: results.__setitem__(s, audio(batched, s)))
                   for seed in (3, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stats = batched.batcher.stats
        assert stats.steps > 0
    finally:
        batched.close()
    for seed in (3, 5):
        assert np.array_equal(results[seed], plain[seed])
    # Each stream's thread was woken once a chunk at most (models/batching/mailbox.py), not once a token.
    assert 0 < stats.handovers <= sum(chunks[2:]) < stats.handed_tokens


def test_a_request_group_prefills_together_on_the_graph_path(static_engine: CosyVoiceSynthesizer) -> None:
    """A Triton batch (models/batching/group.py) on the fixed-shape path: no
    prefill until every member submitted or ended; then all decode together."""
    lm = static_engine.lm
    alone = {seed: list(lm.generate(_input(static_engine, i), _sampler(lm, seed))) for i, seed in ((0, 41), (1, 42))}
    b, rec = _batcher(static_engine, bound=2)
    try:
        with b.group(size=3, timeout_s=60.0) as group:
            first = b.submit(_input(static_engine, 0), _sampler(lm, 41))
            b.run_once()
            assert rec.events == []  # held: the others are on their way
            second = b.submit(_input(static_engine, 1), _sampler(lm, 42))
            group.ended()  # the third failed before the LLM
            while b.active or b.waiting:
                b.run_once()
    finally:
        rec.inner.close()
    assert [e[0] for e in rec.events[:2]] == ["prefill", "prefill"]  # both prefills before the first step
    assert {41: list(first), 42: list(second)} == alone
    assert first._request.decode.stats.batch_max == second._request.decode.stats.batch_max == 2


@pytest.mark.gpu
def test_captured_graph_batching_gives_the_tokens_alone(tiny_static_bundle: Path) -> None:
    """On ort-cuda: the steps replay captured graphs on the engine's graph thread; four concurrent
    seeded streams through the GraphBatcher give the tokens each gives alone through the captured loop."""
    require_cuda_provider()
    plain = load_synthesizer(tiny_static_bundle, settings=SynthesisSettings(backend="ort-cuda", threads=1))
    try:
        assert plain.lm.fixed_size_decode is not None
        alone = {i: list(plain.lm.generate(_input(plain, i), _sampler(plain.lm, 50 + i))) for i in range(4)}
    finally:
        plain.close()
    settings = SynthesisSettings(backend="ort-cuda", threads=1, graph_batching=True,
                                 batching=BatchSettings(max_batch_size=4))
    batched = load_synthesizer(tiny_static_bundle, settings=settings)
    got: dict[int, list[int]] = {}
    try:
        assert isinstance(batched.batcher, GraphBatcher)
        lm = batched.lm

        def run(i: int) -> None:
            got[i] = list(batched.batcher.generate(_input(batched, i), _sampler(lm, 50 + i)))  # type: ignore[union-attr]
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert batched.batcher.stats.shared_steps > 0
    finally:
        batched.close()
    assert got == alone


@contextlib.contextmanager
def _another_first_chunk(worker: GraphThread) -> Iterator[None]:
    """Another stream's first-chunk hold open on `worker` (the order exact: no bound lets held work go)
    until the block ends."""
    worker.order.hold_max_s = 3600.0  # the order exactly, on a loaded machine
    worker.order.max_overtakes = 1 << 30
    opened, release = threading.Event(), threading.Event()

    def other_first_chunk() -> None:
        with worker.first_audio():
            opened.set()
            release.wait(120)

    holder = threading.Thread(target=other_first_chunk)
    holder.start()
    assert opened.wait(30)
    try:
        yield
    finally:
        release.set()
        holder.join(30)


def _drive_in_background(b: GraphBatcher) -> threading.Thread:
    def drive() -> None:
        while b.active or b.waiting:
            b.run_once()

    driver = threading.Thread(target=drive)
    driver.start()
    return driver


def _wait_for_held_llm_work(worker: GraphThread) -> None:
    deadline = time.monotonic() + 120
    while worker.pending(GraphPriority.LLM) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_stream_before_its_first_chunk_is_not_held_by_another_streams_first_chunk(
        static_engine: CosyVoiceSynthesizer) -> None:
    """While another stream's first chunk holds the LLM work on the graph thread, a step that samples a
    token of some stream's own first chunk (`first_tokens`) is first-audio work and runs; once every
    row is past its first chunk the step is LLM work again and waits for the hold."""
    b, rec = _batcher(static_engine, bound=1)
    first_tokens = 3
    driver = None
    try:
        with _another_first_chunk(b.thread):
            stream = b.submit(_input(static_engine, 0), _sampler(b.lm, 11), first_tokens=first_tokens)
            driver = _drive_in_background(b)
            _wait_for_held_llm_work(b.thread)
            steps = [e for e in rec.events if e[0] == "step"]
            # the prefill sampled token 0, two steps tokens 1 and 2 (urgent); the step of token 3 waits
            assert b.thread.pending(GraphPriority.LLM) == 1 and len(steps) == first_tokens - 1
            time.sleep(0.3)
            assert len([e for e in rec.events if e[0] == "step"]) == first_tokens - 1  # still held
        driver.join(120)
        assert len(list(stream)) > first_tokens and not driver.is_alive()
    finally:
        if driver is not None:
            driver.join(120)
        rec.inner.close()  # its decode slots back for the tests after it


def test_a_new_stream_is_not_kept_behind_a_step_held_for_other_streams_first_chunks(
        static_engine: CosyVoiceSynthesizer) -> None:
    """A stream past its first chunk has its step held while another stream's first chunk holds the LLM
    work; that held step blocks the batcher's loop, so a stream arriving then would wait for every hold
    (H200, twenty-first run: one of eight streams ~370 ms late). Its arrival lets the held step go as
    NORMAL work: the newcomer is prefilled and samples its first chunk's tokens with the hold still open."""
    b, rec = _batcher(static_engine, bound=1)
    first_tokens = 3
    newcomer_tokens: list[int] = []
    got = threading.Event()
    driver = puller = None
    try:
        with _another_first_chunk(b.thread):
            speaking = b.submit(_input(static_engine, 0), _sampler(b.lm, 11), first_tokens=1)
            driver = _drive_in_background(b)
            _wait_for_held_llm_work(b.thread)
            assert b.thread.pending(GraphPriority.LLM) == 1  # the speaking stream's step, held
            newcomer = b.submit(_input(static_engine, 1), _sampler(b.lm, 12), first_tokens=first_tokens)

            def pull() -> None:
                for token in newcomer:
                    newcomer_tokens.append(token)
                    if len(newcomer_tokens) == first_tokens:
                        got.set()

            puller = threading.Thread(target=pull)
            puller.start()
            assert got.wait(60), "the newcomer's first chunk waited for the hold"
            assert b.thread.order.open_holds == 1 and b.thread.order_stats()["released"] >= 1
        driver.join(120)
        puller.join(120)
        assert len(list(speaking)) > 1 and len(newcomer_tokens) > first_tokens and not driver.is_alive()
    finally:
        for t in (driver, puller):
            if t is not None:
                t.join(120)
        rec.inner.close()  # its decode slots back for the tests after it


@pytest.mark.parametrize("priority", [GraphPriority.NORMAL, GraphPriority.FIRST_AUDIO])
def test_the_steps_of_a_first_chunk_run_at_the_configured_priority(static_engine: CosyVoiceSynthesizer,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   priority: GraphPriority) -> None:
    """[tts] llm_first_chunk_priority: a step that samples a stream's first-chunk tokens goes to the graph
    thread as NORMAL work (behind the first chunks' flows waiting) or FIRST_AUDIO work (in turn with
    them); every later step is LLM work."""
    b, rec = _batcher(static_engine, bound=1, first_chunk_priority=priority)
    asked: list[GraphPriority | None] = []
    call = b.thread.call

    def spy(work: Callable[[], Any], priority: GraphPriority | None = None, label: str = "") -> Any:
        if label == "llm_batched_step":
            asked.append(priority)
        return call(work, priority, label)

    monkeypatch.setattr(b.thread, "call", spy)
    first_tokens = 3
    try:
        stream = b.submit(_input(static_engine, 0), _sampler(b.lm, 11), first_tokens=first_tokens)
        while b.active or b.waiting:
            b.run_once()
        assert len(list(stream)) > first_tokens
        # the prefill samples token 0; the steps of tokens 1 and 2 are the first chunk's
        assert asked[: first_tokens - 1] == [priority] * (first_tokens - 1)
        assert set(asked[first_tokens - 1:]) == {GraphPriority.LLM}
        settings = IterationSettings(BatchSettings(max_batch_size=rec.rows), rec.batch_sizes, rec.rows, 1)
        with pytest.raises(ValueError, match="NORMAL or FIRST_AUDIO"):
            GraphBatcher(static_engine.lm, rec, b.thread, settings, first_chunk_priority=GraphPriority.LLM)
    finally:
        rec.inner.close()
