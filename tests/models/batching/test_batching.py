"""LLM continuous batching on the tiny bundle: a request's speech tokens (and
its logits, to float tolerance) are the same alone and in a batch that
others join and leave at different steps; cancel frees the slot; a failed
decode step fails the batch's requests and the worker keeps serving."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.backends.base import HostDecodeLoop, Session
from cosyedge_models.batching.kv import BatchDecoder
from cosyedge_models.batching.llm_batcher import LlmBatcher, TokenStream, start_batcher
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.errors import BundleError, SynthesisError
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.llm import LlmInput, SpeechTokenLM
from cosyedge_models.synthesis.sampling import TokenSampler
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer

TEXTS = [
    "Hello world one two.",
    "The quick brown fox jumps over the lazy dog",
    "A",
    "Numbers and dates today",
]


@pytest.fixture(scope="module")
def lm(engine: CosyVoiceSynthesizer) -> SpeechTokenLM:
    return engine.lm


def llm_input(engine: CosyVoiceSynthesizer, i: int) -> LlmInput:
    return LlmInput(text=engine.tokenizer.encode(TEXTS[i]))


def sampler(lm: SpeechTokenLM, seed: int) -> TokenSampler:
    return TokenSampler.seeded(lm.config.sampling, lm.config.eos_token, seed)


def alone(engine: CosyVoiceSynthesizer, i: int, seed: int) -> list[int]:
    return list(engine.lm.generate(llm_input(engine, i), sampler(engine.lm, seed)))


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def drive(batcher: LlmBatcher, joins: Mapping[int, Sequence[tuple[int, LlmInput, TokenSampler]]]
          ) -> tuple[dict[int, TokenStream], int]:
    """Submit each group of requests before round `r` and run rounds until
    everything is done; returns the streams and the most rows seen at once."""
    streams: dict[int, TokenStream] = {}
    most, r = 0, 0
    while r <= max(joins) or batcher.active or batcher.waiting:
        for key, inp, smp in joins.get(r, ()):
            streams[key] = batcher.submit(inp, smp)
        batcher.run_once()
        most = max(most, batcher.active)
        r += 1
    return streams, most


@pytest.mark.parametrize(("schedule", "seeds"), [
    ({0: [0], 3: [1], 5: [2, 3]}, (11, 12, 13, 14)),
    ({0: [1, 3], 1: [0], 9: [2]}, (21, 22, 23, 24)),
])
def test_tokens_are_identical_alone_and_in_a_batch(engine: CosyVoiceSynthesizer, schedule: dict[int, list[int]],
                                                    seeds: tuple[int, ...]) -> None:
    lm = engine.lm
    expected = {i: alone(engine, i, seeds[i]) for i in range(4)}
    assert len({len(t) for t in expected.values()}) > 1, "requests should leave at different steps"
    batcher = LlmBatcher(lm, BatchSettings(max_batch_size=4, compact_min_columns=1))
    joins = {r: [(i, llm_input(engine, i), sampler(lm, seeds[i])) for i in ids] for r, ids in schedule.items()}
    streams, most = drive(batcher, joins)
    assert most >= 3
    assert {i: list(s) for i, s in streams.items()} == expected
    assert len(batcher.decoder) == 0 and batcher.decoder.width == 0


def test_logits_match_alone_while_others_join_and_leave(engine: CosyVoiceSynthesizer) -> None:
    """Feed fixed tokens (no sampling) and compare every step's logp of every
    request with its batch-1 run."""
    lm = engine.lm
    rng = np.random.default_rng(0)
    # (request, join round, steps after the prefill)
    plan = [(0, 0, 12), (1, 2, 6), (2, 3, 14), (3, 7, 4)]
    feeds = {i: rng.integers(0, lm.config.speech_token_size, size=n) for i, _, n in plan}
    prompts = {i: lm.prompt_embeds(llm_input(engine, i)) for i, _, _ in plan}

    ref: dict[int, list[np.ndarray]] = {}
    for i, _, _ in plan:
        loop = HostDecodeLoop(lm.prefill_session, lm.decode_session)
        ref[i] = [loop.prefill(prompts[i])[0]]
        ref[i] += [loop.step(lm.speech_embedding[t][None, None])[0] for t in feeds[i]]

    dec = BatchDecoder(lm.prefill_session, lm.decode_session, compact_min_columns=1)
    got: dict[int, list[np.ndarray]] = {i: [] for i, _, _ in plan}
    r, widths = 0, []
    while r == 0 or len(dec):
        for i, at, _ in plan:
            if at == r:
                logp, cache = dec.prefill(prompts[i])
                got[i].append(logp[0])
                dec.join(i, cache)
        inputs = {i: lm.speech_embedding[feeds[i][len(got[i]) - 1]] for i in dec.slots.ids}
        for i, logp in dec.step(inputs).items():
            got[i].append(logp)
        for i, _, n in plan:
            if i in dec.slots and len(got[i]) == n + 1:
                dec.leave(i)
        widths.append(dec.width)
        r += 1
    for i, _, n in plan:
        assert len(got[i]) == n + 1
        diff = max(float(np.abs(a - b).max()) for a, b in zip(got[i], ref[i], strict=True))
        assert diff < 1e-4, f"request {i}: logp differs by {diff}"
        assert [int(a.argmax()) for a in got[i]] == [int(b.argmax()) for b in ref[i]]
    assert any(b < a for a, b in zip(widths, widths[1:], strict=False)), "padding was never compacted"


def test_concurrent_generate_on_the_worker_thread_matches_alone(engine: CosyVoiceSynthesizer) -> None:
    lm = engine.lm
    seeds = (31, 32, 33, 34)
    expected = {i: alone(engine, i, seeds[i]) for i in range(4)}
    results: dict[int, list[int]] = {}

    with LlmBatcher(lm, BatchSettings(max_batch_size=4)) as batcher:
        def run(i: int) -> None:
            results[i] = list(batcher.generate(llm_input(engine, i), sampler(lm, seeds[i])))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert results == expected


def test_queue_delay_and_priority_with_an_injected_clock(engine: CosyVoiceSynthesizer) -> None:
    lm = engine.lm
    clock = FakeClock()
    batcher = LlmBatcher(lm, BatchSettings(max_batch_size=1, max_queue_delay_ms=50, preferred_batch_sizes=()),
                         clock=clock)
    # max_batch_size 1 is reachable by one request, so the delay does not apply: the
    # higher priority, submitted second, joins first.
    low = batcher.submit(llm_input(engine, 2), sampler(lm, 1), priority=0)
    high = batcher.submit(llm_input(engine, 2), sampler(lm, 2), priority=5)
    batcher.run_once()
    assert batcher.active == 1 and batcher.waiting == 1
    assert batcher._active[next(iter(batcher._active))].priority == 5
    high.close()
    low.close()
    batcher.run_once()
    assert batcher.active == 0 and batcher.waiting == 0

    batcher = LlmBatcher(lm, BatchSettings(max_batch_size=4, preferred_batch_sizes=(2,), max_queue_delay_ms=50),
                         clock=clock)
    clock.t = 100.0
    a = batcher.submit(llm_input(engine, 0), sampler(lm, 1))
    worked, wake_at = batcher.run_once()
    assert (worked, batcher.active) == (False, 0) and wake_at == pytest.approx(100.05)
    clock.t = 100.049
    batcher.run_once()
    assert batcher.active == 0
    clock.t = 100.05
    batcher.run_once()
    assert batcher.active == 1
    a.close()


def test_cancel_frees_the_slot_and_the_others_go_on(engine: CosyVoiceSynthesizer) -> None:
    lm = engine.lm
    seeds = {0: 41, 1: 42, 3: 43}
    expected = {i: alone(engine, i, seed) for i, seed in seeds.items()}
    batcher = LlmBatcher(lm, BatchSettings(max_batch_size=4))
    cancel = threading.Event()
    s0 = batcher.submit(llm_input(engine, 0), sampler(lm, seeds[0]))
    s1 = batcher.submit(llm_input(engine, 1), sampler(lm, seeds[1]), cancel=cancel)
    s3 = batcher.submit(llm_input(engine, 3), sampler(lm, seeds[3]))
    for _ in range(3):
        batcher.run_once()
    assert len(batcher.decoder) == 3
    assert (batcher.stats.steps, batcher.stats.shared_steps, batcher.stats.peak_batch) == (3, 3, 3)
    s0.close()  # the consumer went away
    cancel.set()  # the request was cancelled
    batcher.run_once()
    assert batcher.active == 1 and len(batcher.decoder) == 1
    t0, t1 = list(s0), list(s1)
    assert t0 == expected[0][:len(t0)] and t1 == expected[1][:len(t1)] and len(t1) < len(expected[1])
    while batcher.active:
        batcher.run_once()
    assert list(s3) == expected[3]
    assert batcher.stats.steps > 3 and batcher.stats.shared_steps == 3  # alone, s3's steps are not shared


class FlakySession:
    """A session that raises on chosen calls (counted from 1)."""

    def __init__(self, inner: Session, fail_on: set[int]) -> None:
        self._inner = inner
        self.fail_on = fail_on
        self.calls = 0
        self.name, self.input_names, self.output_names = inner.name, inner.input_names, inner.output_names

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        self.calls += 1
        if self.calls in self.fail_on:
            raise SynthesisError(f"{self.name}: injected failure")
        return self._inner.run(inputs, outputs)

    def memory_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_a_failed_step_fails_the_batch_and_the_worker_keeps_serving(engine: CosyVoiceSynthesizer) -> None:
    flaky_lm = copy.copy(engine.lm)
    flaky_lm.decode_session = FlakySession(engine.lm.decode_session, fail_on={3})
    seeds = (51, 52)
    expected = alone(engine, 3, seeds[1])
    # Preferred size 2 and a long delay: the first request waits for the second, so
    # both are in the batch when the third decode run fails.
    settings = BatchSettings(max_batch_size=4, preferred_batch_sizes=(2,), max_queue_delay_ms=10_000)
    with LlmBatcher(flaky_lm, settings) as batcher:
        s0 = batcher.submit(llm_input(engine, 0), sampler(flaky_lm, seeds[0]))
        s1 = batcher.submit(llm_input(engine, 1), sampler(flaky_lm, seeds[0]))
        for s in (s0, s1):
            with pytest.raises(SynthesisError,
                               match=r"batched decode step failed \(2 requests in the batch\).*injected"):
                list(s)
        assert batcher.active == 0 and len(batcher.decoder) == 0
        batcher.delay_ms = 0.0  # the engine's load hint: a lone request joins at once
        # The worker is alive and the next request gets exactly its tokens.
        assert list(batcher.generate(llm_input(engine, 3), sampler(flaky_lm, seeds[1]))) == expected


def test_stop_fails_the_waiting_requests_with_a_clear_error(engine: CosyVoiceSynthesizer) -> None:
    batcher = LlmBatcher(engine.lm, BatchSettings())
    stream = batcher.submit(llm_input(engine, 0), sampler(engine.lm, 1))
    batcher.stop()
    with pytest.raises(SynthesisError, match="batcher stopped before the request finished"):
        list(stream)
    with pytest.raises(SynthesisError, match="batcher is stopped"):
        batcher.submit(llm_input(engine, 0), sampler(engine.lm, 1))


@pytest.fixture(scope="module")
def batched(tiny_bundle: Path) -> Iterator[CosyVoiceSynthesizer]:
    eng = load_synthesizer(tiny_bundle, settings=SynthesisSettings(batching=BatchSettings(max_batch_size=4)))
    yield eng
    eng.close()


def test_engine_with_batching_gives_the_same_audio(engine: CosyVoiceSynthesizer, batched: CosyVoiceSynthesizer) -> None:
    def audio(eng: CosyVoiceSynthesizer, seed: int) -> np.ndarray:
        chunks = list(eng.synthesize(SynthesisRequest(text=TEXTS[1], seed=seed)))
        return np.concatenate([c.pcm for c in chunks])

    plain = {seed: audio(engine, seed) for seed in (3, 5)}
    results: dict[int, np.ndarray] = {}
    threads = [threading.Thread(target=lambda s=seed: results.__setitem__(s, audio(batched, s)))
               for seed in (3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for seed in (3, 5):
        assert np.array_equal(results[seed], plain[seed])


def test_engine_cancel_ends_the_stream_and_leaves_no_row(batched: CosyVoiceSynthesizer) -> None:
    assert batched.batcher is not None
    cancel = threading.Event()
    chunks = batched.synthesize(SynthesisRequest(text=TEXTS[1] * 3, seed=3), cancel)
    next(chunks)
    cancel.set()
    assert list(chunks) == []
    deadline = time.monotonic() + 10
    while batched.batcher.active and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker frees the row at its next step boundary
    assert batched.batcher.active == 0


def test_trt_batch_size_is_checked_against_the_decode_profile(engine: CosyVoiceSynthesizer) -> None:
    with pytest.raises(BundleError, match=r"max_batch_size 8 exceeds the llm_decode engine's largest batch \(4\)"):
        start_batcher(engine.bundle, "trt", engine.lm, BatchSettings(max_batch_size=8))
    assert start_batcher(engine.bundle, "ort", engine.lm, None) is None


def test_a_failed_prefill_fails_only_that_request(engine: CosyVoiceSynthesizer) -> None:
    flaky_lm = copy.copy(engine.lm)
    flaky_lm.prefill_session = FlakySession(engine.lm.prefill_session, fail_on={2})
    expected = alone(engine, 0, 61)
    batcher = LlmBatcher(flaky_lm, BatchSettings(max_batch_size=4))
    ok = batcher.submit(llm_input(engine, 0), sampler(flaky_lm, 61))
    batcher.run_once()
    bad = batcher.submit(llm_input(engine, 1), sampler(flaky_lm, 62))
    batcher.run_once()
    assert batcher.active == 1
    with pytest.raises(SynthesisError, match="LLM prefill failed: llm_prefill: injected failure"):
        list(bad)
    while batcher.active:
        batcher.run_once()
    assert list(ok) == expected
