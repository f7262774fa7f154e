"""The streaming flow encoder windows batched across streams (flow_encoder_batch_b<B>_t<T>, exported
with --batch-flow-sizes by edge_build/export/flow_encoder_batch.py) and their runtime
(models/batching/batched_encoder.py): only static shapes; streams whose calls wait together share a
replay and each gets the mel it gets alone on the dynamic graph; a voice's prefix is seeded into a
lane; a stream beyond the lanes takes the single-stream slots; a cache that outgrows its lane moves
to the host caches exactly. On the CPU they run without capture; `-m gpu` would capture them."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from cosyedge_models.backends.encoder_cache import EncoderCache, HostEncoderCache
from cosyedge_models.backends.graph_thread import GraphThread
from cosyedge_models.backends.ort import OrtSession
from cosyedge_models.backends.ort_cache import DeviceCopier
from cosyedge_models.backends.ort_static_encoder import StaticEncoderCache, StaticEncoderGraphs
from cosyedge_models.batching.batched_encoder import BatchedEncoderCache, BatchEncoderGraphs
from cosyedge_models.bundle.loader import BATCH_ENCODER_NAME, STATIC_ENCODER_PREFIX, Bundle, load_bundle
from cosyedge_models.synthesis.flow import FlowDecoder, FlowPrompt
from cosyedge_models.synthesis.voice_cache import build_flow_prefix

from tests.conftest import BATCH_FLOW_SIZES, STATIC_FLOW_CACHE, STATIC_FLOW_WINDOWS
from tests.models.flow_streams import Recording, flow_sessions, stream_mel
from tests.support.components import require_cuda_provider


def _prompt(bundle: Bundle, seed: int, tokens: int = 12) -> FlowPrompt:
    rng = np.random.default_rng(seed)
    return FlowPrompt(tokens=rng.integers(0, 50, tokens).astype(np.int64),
                      feat=rng.standard_normal((2 * tokens, bundle.mel_bins)).astype(np.float32),
                      embedding=rng.standard_normal(192).astype(np.float32))


def test_batched_encoder_graphs_have_only_fixed_shapes(static_flow_bundle: Path) -> None:
    bundle = load_bundle(static_flow_bundle)
    found = {(int(m.group(1)), int(m.group(2))) for n in bundle.stages if (m := BATCH_ENCODER_NAME.match(n))}
    look = bundle.flow.pre_lookahead_len
    assert found == {(b, w // 2 + look) for b in BATCH_FLOW_SIZES for w in STATIC_FLOW_WINDOWS}
    for b, t in found:
        name = f"flow_encoder_batch_b{b}_t{t}"
        model = onnx.load(str(bundle.stages[name].path), load_external_data=False)
        for value in [*model.graph.input, *model.graph.output]:
            assert all(d.HasField("dim_value") for d in value.type.tensor_type.shape.dim), (name, value.name)
        entry = bundle.stages[name].raw
        assert entry["lanes"] == max(BATCH_FLOW_SIZES) and entry["cache_tokens"] == STATIC_FLOW_CACHE // 2


class _Streams:
    """The dynamic flow graphs, the single-stream encoder slots (`slots`) and the batched lanes."""

    def __init__(self, bundle_dir: Path, thread: GraphThread, slots: int = 1, device: str = "cpu") -> None:
        self.sessions, self.bundle = flow_sessions(bundle_dir, device, "flow_encoder_")
        self.enc, self.est = self.sessions["flow_encoder"], self.sessions["flow_estimator"]
        host = FlowDecoder(self.bundle, self.enc, self.est)
        self.spec = host.encoder_spec
        statics = [s for n, s in self.sessions.items() if n.startswith(STATIC_ENCODER_PREFIX)]
        copier = DeviceCopier(device)
        self.static = StaticEncoderGraphs(statics, (device, 0), copier, self.spec, slots, thread)
        self.static.warm_up()
        batched: dict[tuple[int, int], OrtSession] = {}
        for name, s in self.sessions.items():
            if (m := BATCH_ENCODER_NAME.match(name)) is not None:
                batched[(int(m.group(1)), int(m.group(2)))] = s
        self.graphs = BatchEncoderGraphs(batched, (device, 0), copier, self.spec, thread, self.static)
        self.graphs.warm_up()
        assert self.graphs.disabled is None and self.graphs.capture == (device == "cuda")
        self.made: Recording[EncoderCache] = Recording(self.graphs)

    def decoder(self, batched: bool = True) -> FlowDecoder:
        return FlowDecoder(self.bundle, self.enc, self.est, encoder_cache_factory=self.made) if batched \
            else FlowDecoder(self.bundle, self.enc, self.est)

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()


def _toks(bundle: Bundle, seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, bundle.llm.speech_token_size, n)


def _two_in_lanes_one_on_a_slot(bundle_dir: Path, device: str, atol: float) -> BatchEncoderGraphs:
    """Three streams, two lanes: the graph thread is held until the two streams in lanes have both
    queued their first call, so that call is one replay of two rows; the third stream takes the
    single-stream slot. Each stream's mel is the dynamic graph's alone."""
    with GraphThread() as thread:
        s = _Streams(bundle_dir, thread, device=device)
        try:
            lengths = (60, 45, 52)
            prompts = [_prompt(s.bundle, 10 + i) for i in range(3)]
            toks = [_toks(s.bundle, 20 + i, n) for i, n in enumerate(lengths)]
            alone = [stream_mel(s.decoder(False), prompts[i], toks[i]) for i in range(3)]
            gate, got = threading.Event(), [np.zeros(0)] * 3
            hold = thread.submit(gate.wait, label="test_hold")

            def run(i: int) -> None:
                got[i] = stream_mel(s.decoder(), prompts[i], toks[i])

            workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for w in workers:
                w.start()
            while s.graphs.waiting < 2:
                threading.Event().wait(0.005)
            gate.set()
            hold.result()
            run(2)  # the lanes are taken until the two streams end: this one is on the slot
            for w in workers:
                w.join()
            kinds = [type(c) for c in s.made.made]
        finally:
            s.close()
    for i in range(3):
        assert got[i].shape == alone[i].shape == (1, s.bundle.mel_bins, 2 * lengths[i])
        np.testing.assert_allclose(got[i], alone[i], rtol=0, atol=atol)
    assert kinds.count(BatchedEncoderCache) == 2 and kinds.count(StaticEncoderCache) == 1
    stats = s.graphs.stats
    assert stats.shared_replays >= 1 and stats.peak_batch == 2 and s.graphs.moves == 0
    assert stats.rows == s.graphs.replays + stats.shared_replays  # two rows in each shared replay
    assert s.graphs.free_slots == 2  # both lanes went back
    return s.graphs


def test_streams_waiting_together_share_a_replay_and_each_gets_its_mel_alone(static_flow_bundle: Path) -> None:
    _two_in_lanes_one_on_a_slot(static_flow_bundle, "cpu", 1e-5)


@pytest.mark.gpu
def test_captured_batched_encoder_streams_get_their_mel_alone(static_flow_bundle: Path) -> None:
    require_cuda_provider()
    # TF32 kernels on a GPU, as the single-stream encoder graphs' test allows
    assert _two_in_lanes_one_on_a_slot(static_flow_bundle, "cuda", 5e-3).capture


def test_a_voice_prefix_is_seeded_into_a_lane(static_flow_bundle: Path) -> None:
    """A 60-token prompt's complete chunks come from the voice's prefix (built on the host), seeded
    into the lane; the stream goes on in the lane with the dynamic graph's mel."""
    with GraphThread() as thread:
        s = _Streams(static_flow_bundle, thread)
        try:
            prompt, toks = _prompt(s.bundle, 3, 60), _toks(s.bundle, 4, 50)
            prefix = build_flow_prefix(s.decoder(False), prompt)
            alone = stream_mel(s.decoder(False), prompt, toks, prefix=prefix)
            got = stream_mel(s.decoder(), prompt, toks, prefix=prefix)
        finally:
            s.close()
    np.testing.assert_allclose(got, alone, rtol=0, atol=1e-5)
    assert isinstance(s.made.made[0], BatchedEncoderCache) and s.graphs.replays > 0 and s.graphs.moves == 0


def test_a_cache_that_outgrows_its_lane_moves_exactly(static_flow_bundle: Path) -> None:
    """190 tokens outgrow the lane's 160 cached tokens midway: the lane's rows go to the host caches,
    once, and the stream's mel is the dynamic graph's."""
    with GraphThread() as thread:
        s = _Streams(static_flow_bundle, thread)
        try:
            prompt, toks = _prompt(s.bundle, 5), _toks(s.bundle, 6, 190)
            alone = stream_mel(s.decoder(False), prompt, toks)
            got = stream_mel(s.decoder(), prompt, toks)
        finally:
            s.close()
    np.testing.assert_allclose(got, alone, rtol=0, atol=1e-5)
    assert s.graphs.moves == 1 and s.graphs.replays > 0
    assert isinstance(s.made.made[0], BatchedEncoderCache)


def test_a_stream_of_other_shapes_takes_the_fallback(static_flow_bundle: Path) -> None:
    """An encoder spec the graphs were not exported for (another chunk) never takes a lane."""
    with GraphThread() as thread:
        s = _Streams(static_flow_bundle, thread)
        try:
            other = dataclasses.replace(s.spec, chunk_tokens=s.spec.chunk_tokens + 1)
            cache = s.graphs(s.enc, other)
            assert isinstance(cache, HostEncoderCache)  # the static slots refuse it too
            cache.close()
        finally:
            s.close()


def test_a_call_made_on_the_graph_thread_runs_there(static_flow_bundle: Path) -> None:
    """A stream driven from the graph thread itself (its turn would wait for itself) is served inline."""
    with GraphThread() as thread:
        s = _Streams(static_flow_bundle, thread)
        try:
            prompt, toks = _prompt(s.bundle, 7), _toks(s.bundle, 8, 40)
            alone = stream_mel(s.decoder(False), prompt, toks)
            got = thread.call(lambda: stream_mel(s.decoder(), prompt, toks), label="test_on_thread")
        finally:
            s.close()
    np.testing.assert_allclose(got, alone, rtol=0, atol=1e-5)
    assert s.graphs.stats.rows > 0


@contextlib.contextmanager
def _on_lanes(bundle_dir: Path) -> Iterator[tuple[GraphThread, _Streams]]:
    """A graph thread and the bundle's encoder lanes on it, closed after."""
    with GraphThread() as thread:
        s = _Streams(bundle_dir, thread)
        try:
            yield thread, s
        finally:
            s.close()


def _spied_seeds(graphs: BatchEncoderGraphs) -> list[str]:
    """The thread of each lane seed the graphs write from now on."""
    seeds: list[str] = []
    real = graphs.seed

    def seed(lane: Any, prefix: Any) -> None:
        seeds.append(threading.current_thread().name)
        real(lane, prefix)

    graphs.seed = seed  # type: ignore[method-assign]
    return seeds


def test_a_lanes_seed_is_queued_and_runs_once_at_its_first_use(static_flow_bundle: Path) -> None:
    """Opening a stream on a voice does not wait for its lane's seed (its synchronous uploads and copies
    stood before every stream's LLM): the seed is queued for the graph thread. Here the graph thread is
    held, so the stream's first encoder call runs it itself, once; the queued turn then finds it done.
    The mel is the dynamic graph's."""
    with _on_lanes(static_flow_bundle) as (thread, s):
        prompt, toks = _prompt(s.bundle, 3, 60), _toks(s.bundle, 4, 50)
        prefix = build_flow_prefix(s.decoder(False), prompt)
        alone = stream_mel(s.decoder(False), prompt, toks, prefix=prefix)
        seeds = _spied_seeds(s.graphs)
        gate = threading.Event()
        hold = thread.submit(gate.wait, label="test_hold")
        got: list[np.ndarray] = []
        stream = threading.Thread(target=lambda: got.append(stream_mel(s.decoder(), prompt, toks, prefix=prefix)),
                                  name="the-stream")
        stream.start()
        deadline = time.monotonic() + 30
        while not seeds and time.monotonic() < deadline:
            time.sleep(0.005)
        assert seeds == ["the-stream"] and not got  # seeded by its first use; its replay waits
        gate.set()
        hold.result()
        stream.join(60)
        thread.call(lambda: None)  # every turn queued before has run
    assert seeds == ["the-stream"]
    np.testing.assert_allclose(got[0], alone, rtol=0, atol=1e-5)


def test_a_stream_closed_before_its_first_call_never_seeds_its_lane(static_flow_bundle: Path) -> None:
    with _on_lanes(static_flow_bundle) as (thread, s):
        prefix = build_flow_prefix(s.decoder(False), _prompt(s.bundle, 3, 60))
        assert prefix is not None
        seeds = _spied_seeds(s.graphs)
        free = s.graphs.free_slots
        gate = threading.Event()
        hold = thread.submit(gate.wait, label="test_hold")
        cache = s.graphs(s.enc, s.spec)
        assert isinstance(cache, BatchedEncoderCache)
        cache.preload(prefix.encoder)
        cache.close()  # before its turn: the lane goes back unseeded, and stays so (reset, not refreshed)
        gate.set()
        hold.result()
        thread.call(lambda: None)
        assert seeds == [] and s.graphs.free_slots == free
        assert s.graphs.stats.refreshes == 0


def test_a_failed_seed_fails_the_streams_first_call(static_flow_bundle: Path) -> None:
    with _on_lanes(static_flow_bundle) as (thread, s):
        prompt = _prompt(s.bundle, 3, 60)
        prefix = build_flow_prefix(s.decoder(False), prompt)
        assert prefix is not None

        def broken(lane: Any, p: Any) -> None:
            raise RuntimeError("device copy failed")

        s.graphs.seed = broken  # type: ignore[method-assign]
        cache = s.graphs(s.enc, s.spec)
        cache.preload(prefix.encoder)
        thread.call(lambda: None)  # its turn ran and failed
        with pytest.raises(RuntimeError, match="device copy failed"):
            cache.encode(_toks(s.bundle, 4, 30), prompt.embedding, 3, 20)
        cache.close()


def test_a_lanes_seed_runs_on_the_graph_thread_not_the_opening_one(static_flow_bundle: Path) -> None:
    with _on_lanes(static_flow_bundle) as (thread, s):
        prefix = build_flow_prefix(s.decoder(False), _prompt(s.bundle, 3, 60))
        assert prefix is not None
        seeds = _spied_seeds(s.graphs)
        cache = s.graphs(s.enc, s.spec)
        cache.preload(prefix.encoder)
        thread.call(lambda: None)
        assert len(seeds) == 1 and seeds[0] != threading.current_thread().name
        cache.close()


def test_a_voices_lane_is_refreshed_at_its_end_and_the_voices_next_stream_writes_nothing(
        static_flow_bundle: Path) -> None:
    """A lane given back by a stream of a saved voice gets the voice's conv histories again (its rows
    are intact), so the voice's next stream there writes nothing and queues no turn (its seed took a
    graph-thread turn before its LLM: 7.2 ms at eight streams on the H100, twenty-ninth run). A stream
    without a voice after it zeroes the lane before its first call, and another voice seeds it in full;
    each hears what it hears alone on the dynamic graph."""
    with _on_lanes(static_flow_bundle) as (thread, s):
        prompt, toks = _prompt(s.bundle, 3, 60), _toks(s.bundle, 4, 50)
        other_prompt = _prompt(s.bundle, 5, 60)
        prefix, other = (build_flow_prefix(s.decoder(False), p) for p in (prompt, other_prompt))
        want = {name: stream_mel(s.decoder(False), p, toks, prefix=x)
                for name, p, x in (("voice", prompt, prefix), ("none", prompt, None), ("other", other_prompt, other))}
        seeds = _spied_seeds(s.graphs)
        submitted: list[str] = []
        real_submit = thread.submit

        def counted(*args: Any, **kwargs: Any) -> Any:
            submitted.append(str(kwargs.get("label", "")))
            return real_submit(*args, **kwargs)

        thread.submit = counted  # type: ignore[method-assign]
        got = {"first": stream_mel(s.decoder(), prompt, toks, prefix=prefix)}  # seeded, refreshed at its end
        assert len(seeds) == 1 and submitted.count("flow_encoder_seed") == 1
        assert (s.graphs.stats.fresh, s.graphs.stats.refreshes) == (0, 1)
        got["again"] = stream_mel(s.decoder(), prompt, toks, prefix=prefix)  # the same lane (the last given back)
        assert len(seeds) == 1 and submitted.count("flow_encoder_seed") == 1  # nothing written, no turn
        assert (s.graphs.stats.fresh, s.graphs.stats.refreshes) == (1, 2)
        got["none"] = stream_mel(s.decoder(), prompt, toks)  # the voice's histories there: zeroed first
        got["other"] = stream_mel(s.decoder(), other_prompt, toks, prefix=other)
        assert len(seeds) == 2 and (s.graphs.stats.fresh, s.graphs.stats.refreshes) == (1, 3)
    for name, expected in (("first", "voice"), ("again", "voice"), ("none", "none"), ("other", "other")):
        np.testing.assert_allclose(got[name], want[expected], rtol=0, atol=1e-5, err_msg=name)


def test_a_prepared_voice_is_in_every_free_encoder_lane(static_flow_bundle: Path) -> None:
    """prepare_voice seeds the voice's encoder prefix into every free lane (seed_free, beside the flow
    lanes'), so its first streams, however many open at once, find their lanes fresh: no seed, no turn;
    each hears what it hears alone. A prefix that leaves no room for a window seeds none."""
    with _on_lanes(static_flow_bundle) as (thread, s):
        prompt, toks = _prompt(s.bundle, 3, 60), _toks(s.bundle, 4, 50)
        prefix = build_flow_prefix(s.decoder(False), prompt)
        assert prefix is not None
        alone = stream_mel(s.decoder(False), prompt, toks, prefix=prefix)
        free = s.graphs.free_slots
        assert free >= 2 and s.graphs.seed_free(prefix.encoder) == free and s.graphs.free_slots == free
        seeds = _spied_seeds(s.graphs)
        got: list[np.ndarray] = []
        streams = [threading.Thread(target=lambda: got.append(stream_mel(s.decoder(), prompt, toks, prefix=prefix)))
                   for _ in range(2)]
        for t in streams:
            t.start()
        for t in streams:
            t.join(60)
        assert seeds == [] and s.graphs.stats.fresh == 2 and len(got) == 2
        too_long = build_flow_prefix(s.decoder(False), _prompt(s.bundle, 5, 190))
        assert too_long is not None and too_long.encoder.tokens > s.graphs.cache_tokens - s.graphs.windows[0]
        assert s.graphs.seed_free(too_long.encoder) == 0 and seeds == []
    for mel in got:
        np.testing.assert_allclose(mel, alone, rtol=0, atol=1e-5)
