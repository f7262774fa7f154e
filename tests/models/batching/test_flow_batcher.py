"""Concurrent streams' estimator windows as one batched replay (models/batching/flow_batcher.py)
through the engine (graph_flow + graph_flow_batch), on the CPU without capture: the streams
that meet on the graph thread share a replay, keep their first-chunk priority, and give the
audio each gives alone; a saved voice's prefix seeded into a lane gives the single-stream
slot's windows."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.fixed_shapes import OVERFLOW_FLOW_SLOTS
from cosyedge_models.backends.flow_cache import PrefixRows, StepCache, StepCacheSpec, read_only
from cosyedge_models.backends.graph_thread import GraphPriority, GraphThread
from cosyedge_models.backends.ort import OrtSession
from cosyedge_models.backends.ort_cache import DeviceCopier
from cosyedge_models.backends.ort_static_flow import StaticFlowGraphs, StaticStepCache
from cosyedge_models.batching.batched_flow import BatchFlowGraphs, batch_flow_sessions, lane_bytes
from cosyedge_models.batching.flow_batcher import BatchedFlowCaches, BatchedStepCache, FlowBatcher
from cosyedge_models.bundle.loader import STATIC_FLOW_PREFIX, Bundle
from cosyedge_models.errors import RequestError, SynthesisError
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer

from tests.conftest import STATIC_FLOW_WINDOWS
from tests.models.batching.test_batched_flow import _feeds
from tests.models.flow_streams import flow_sessions

TEXTS = ("Hello there, this is the first batched flow stream.", "And here is a second stream, a bit different.")


def _audio(eng: CosyVoiceSynthesizer, i: int) -> np.ndarray:
    return np.concatenate([c.pcm for c in eng.synthesize(SynthesisRequest(text=TEXTS[i], seed=3 + i, stream=True))])


def _settings(batch: bool) -> SynthesisSettings:
    # the encoder on the request threads: the graph thread runs only estimator windows here
    return SynthesisSettings(backend="ort", threads=1, overlap_stages=False, graph_flow=True, graph_encoder=False,
                             graph_flow_batch=batch)


@contextlib.contextmanager
def _lanes(static_flow_bundle: Path, groups: int) -> Iterator[
        tuple[dict[str, OrtSession], Bundle, dict[tuple[int, int], OrtSession], StaticFlowGraphs, BatchFlowGraphs,
              GraphThread]]:
    """The bundle's flow sessions, single-stream slots (one request) and batched lanes (`groups`
    groups), warmed up on one graph thread; all closed after."""
    sessions, bundle = flow_sessions(static_flow_bundle, "cpu", STATIC_FLOW_PREFIX)
    batched = _batched_sessions(bundle)
    statics = [s for n, s in sessions.items() if n.startswith(STATIC_FLOW_PREFIX)]
    copier = DeviceCopier("cpu")
    thread = GraphThread().start()
    try:
        single = StaticFlowGraphs(statics, ("cpu", 0), copier, max_slots=1, thread=thread)
        single.warm_up()
        graphs = BatchFlowGraphs(batched, ("cpu", 0), copier, groups=groups)
        thread.call(graphs.warm_up)
        yield sessions, bundle, batched, single, graphs, thread
    finally:
        thread.close()
        for s in [*sessions.values(), *batched.values()]:
            s.close()


@contextlib.contextmanager
def _one_group(static_flow_bundle: Path, seed: int, windows: int) -> Iterator[
        tuple[dict[str, OrtSession], BatchedFlowCaches, StepCacheSpec, BatchFlowGraphs, GraphThread, int, PrefixRows,
              np.ndarray, list[dict[str, np.ndarray]]]]:
    """One group of lanes (Euler step 0) behind BatchedFlowCaches, a saved prefix of two chunks (random
    rows and conv history, `seed`) and `windows` windows' feeds."""
    with _lanes(static_flow_bundle, groups=1) as (sessions, bundle, _, single, graphs, thread):
        caches = BatchedFlowCaches(FlowBatcher(graphs, thread), single, single)
        spec = StepCacheSpec(single.row, single.conv, np.dtype(np.float32), euler_step=0)
        chunk = int(bundle.manifest["stages"][f"{STATIC_FLOW_PREFIX}{STATIC_FLOW_WINDOWS[0]}"]["chunk_frames"])
        channels = int(sessions["flow_estimator"].input_shapes["x"][1])
        rng = np.random.default_rng(seed)
        rows = PrefixRows(rng.standard_normal((2 * chunk, *single.row)).astype(np.float32))
        conv = read_only(rng.standard_normal(single.conv).astype(np.float32))  # as a voice's (FlowPrefix)
        feeds = [_feeds(rng, channels, STATIC_FLOW_WINDOWS[0]) for _ in range(windows)]
        yield sessions, caches, spec, graphs, thread, chunk, rows, conv, feeds


def _batched_sessions(bundle: Bundle) -> dict[tuple[int, int], OrtSession]:
    backend = create_backend("ort")
    found = batch_flow_sessions(bundle, lambda name, path: backend.load(name, path, threads=1))
    return {k: v for k, v in found.items() if isinstance(v, OrtSession)}


def test_concurrent_streams_share_replays_and_sound_as_alone(static_flow_bundle: Path) -> None:
    plain = load_synthesizer(static_flow_bundle, "ort", _settings(False))
    try:
        assert plain.graphs.flow_batch is None
        single = {i: _audio(plain, i) for i in range(2)}  # today's single-stream fixed-shape path
    finally:
        plain.close()
    eng = load_synthesizer(static_flow_bundle, "ort", _settings(True))
    try:
        batcher = eng.graphs.flow_batch
        assert isinstance(batcher, FlowBatcher) and isinstance(eng.flow.cache_factory, BatchedFlowCaches)
        # the single-stream slots only for streams beyond the lanes (8 asked by default)
        assert eng.static_flow is not None
        assert eng.static_flow.max_slots == OVERFLOW_FLOW_SLOTS * eng.bundle.flow.n_timesteps  # a step cache each
        alone = {i: _audio(eng, i) for i in range(2)}
        assert batcher.stats.shared_replays == 0 and batcher.stats.replays > 0
        assert batcher.lanes.in_use == 0  # every lane given back
        # hold the graph thread until both streams' first windows wait: they meet as one replay
        seen: dict[str, int] = {}

        def hold() -> None:
            deadline = time.monotonic() + 120
            while batcher.waiting < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["waiting"] = batcher.waiting
            seen["first_audio"] = batcher.thread.pending(GraphPriority.FIRST_AUDIO)

        held = batcher.thread.submit(hold)
        got: dict[int, np.ndarray] = {}
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                got[i] = _audio(eng, i)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        held.result(180)
        for t in threads:
            t.join(300)
        assert not errors, errors
        # both first-chunk windows kept their priority while they waited
        assert seen == {"waiting": 2, "first_audio": 2}
        stats = batcher.stats.as_dict()
        assert stats["shared_replays"] >= 1 and stats["peak_batch"] == 2 and stats["fallbacks"] == 0
        # every replay counted by its window, every single-stream one by what else waited
        assert sum(stats["windows"].values()) == stats["replays"]  # type: ignore[union-attr]
        assert sum(stats["singles"].values()) == stats["batch_sizes"].get(1, 0)  # type: ignore[union-attr]
        assert batcher.lanes.in_use == 0
    finally:
        eng.close()
    for i in range(2):
        assert got[i].shape == alone[i].shape == single[i].shape
        np.testing.assert_allclose(got[i], alone[i], rtol=0, atol=1e-4)
        np.testing.assert_allclose(alone[i], single[i], rtol=0, atol=1e-4)


def test_the_encoder_has_a_slot_for_every_lane_and_single_stream_slot(static_flow_bundle: Path) -> None:
    """Streams in the batched lanes run their encoder on the fixed-shape encoder graphs too (with
    slots for the single-stream requests only, six of eight streams took the dynamic encoder)."""
    settings = SynthesisSettings(backend="ort", threads=1, overlap_stages=False, graph_flow=True,
                                 graph_flow_batch=True)
    eng = load_synthesizer(static_flow_bundle, "ort", settings)
    try:
        batcher, encoder = eng.graphs.flow_batch, eng.static_encoder
        assert batcher is not None and encoder is not None
        assert encoder.max_slots == OVERFLOW_FLOW_SLOTS + batcher.graphs.lanes
        assert _audio(eng, 0).size > 0 and batcher.stats.replays > 0
    finally:
        eng.close()


def test_a_saved_prefix_in_a_lane_gives_the_single_stream_windows(static_flow_bundle: Path) -> None:
    """preload() seeds a lane (attention layout) as a StaticSlot (frame-major); the windows after
    it, a bounded left context's trim and a move to the dynamic graph keep the single-stream results."""
    with _lanes(static_flow_bundle, groups=2) as (sessions, bundle, batched, single, graphs, thread):
        assert lane_bytes(batched, 2) == 2 * graphs.slot_bytes  # what the engine budgets a stream on a GPU
        batcher = FlowBatcher(graphs, thread)
        caches = BatchedFlowCaches(batcher, single, single)
        spec = StepCacheSpec(single.row, single.conv, np.dtype(np.float32), euler_step=1)
        chunk = int(bundle.manifest["stages"][f"{STATIC_FLOW_PREFIX}{STATIC_FLOW_WINDOWS[0]}"]["chunk_frames"])
        channels = int(sessions["flow_estimator"].input_shapes["x"][1])
        rng = np.random.default_rng(4)
        rows = PrefixRows(rng.standard_normal((2 * chunk, *single.row)).astype(np.float32))
        conv = rng.standard_normal(single.conv).astype(np.float32)
        ref = single(sessions["flow_estimator"], spec)
        got = caches(sessions["flow_estimator"], spec)
        assert isinstance(ref, StaticStepCache) and isinstance(got, BatchedStepCache)
        assert got.on_graph and batcher.lanes.in_use == 1
        for cache in (ref, got):
            cache.preload(rows, conv)
        for frames, commit in ((STATIC_FLOW_WINDOWS[0], chunk), (STATIC_FLOW_WINDOWS[1], 2 * chunk)):
            feeds = _feeds(rng, channels, frames)
            want = ref.run(feeds, commit)
            np.testing.assert_allclose(got.run(feeds, commit), want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
            assert got.length == ref.length
        # a window beyond the largest moves the stream to the dynamic graph, with its rows
        feeds = {**_feeds(rng, channels, STATIC_FLOW_WINDOWS[-1] + 8),  # the dynamic graph's inputs too
                 "chunk_frames": np.full(2, chunk, np.int64), "commit": np.zeros(chunk, np.float32)}
        want = ref.run(feeds, chunk)
        np.testing.assert_allclose(got.run(feeds, chunk), want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
        assert not got.on_graph and batcher.stats.moves == 1 and batcher.lanes.in_use == 0
        ref.close()
        got.close()
        with pytest.raises(RuntimeError, match="after close"):
            got.run(feeds, 0)
        # bounded left context: the lane is trimmed (its last `visible` frames to the front) as the slot is
        bounded = StepCacheSpec(single.row, single.conv, np.dtype(np.float32), visible=chunk, euler_step=0)
        ref, got = single(sessions["flow_estimator"], bounded), caches(sessions["flow_estimator"], bounded)
        assert isinstance(ref, StaticStepCache) and isinstance(got, BatchedStepCache) and got.on_graph
        trimmed = 0
        for _ in range(8):
            feeds = _feeds(rng, channels, STATIC_FLOW_WINDOWS[0])
            want = ref.run(feeds, chunk)
            np.testing.assert_allclose(got.run(feeds, chunk), want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
            before = ref.length
            ref.trim()
            got.trim()
            trimmed += ref.length < before
            assert got.length == ref.length and got.on_graph
        assert trimmed >= 1
        ref.close()
        got.close()
        # more streams than lanes: the rest take the single-stream path, as without batching
        made = [caches(sessions["flow_estimator"], bounded) for _ in range(graphs.lanes + 1)]
        assert [isinstance(c, BatchedStepCache) for c in made] == [True] * graphs.lanes + [False]
        assert batcher.stats.fallbacks == 1 and batcher.lanes.in_use == graphs.lanes
        for cache in made:
            cache.close()
        assert batcher.lanes.in_use == 0


def test_a_lane_keeps_its_saved_prefix_for_the_next_stream_of_that_voice(static_flow_bundle: Path) -> None:
    """Seeding a lane from the host took seconds a request at full size (10 Euler steps' lanes); a
    lane whose last stream had the same saved prefix still holds it (streams write past it), so
    the next stream of that voice writes only its conv history, and hears the same."""
    with _one_group(static_flow_bundle, seed=11, windows=3) as (sessions, caches, spec, graphs, thread, chunk, rows,
                                                               conv, feeds):

        def stream(prefix: PrefixRows | None, history: np.ndarray = conv) -> list[np.ndarray]:
            cache = caches(sessions["flow_estimator"], spec)
            assert isinstance(cache, BatchedStepCache) and cache.on_graph
            if prefix is not None:
                cache.preload(prefix, history)
            out = [cache.run(f, chunk) for f in feeds]
            cache.close()
            return out

        def counts() -> tuple[object, ...]:
            thread.call(lambda: None)  # after the refresh queued at the stream's end (lanes.py)
            report = caches.batcher.report()
            return tuple(report[k] for k in ("seeds", "reuses", "fresh", "refreshes"))

        first = stream(rows)
        assert counts() == (1, 1, 0, 1)  # the seed, then at its end the lane's conv history again (a reuse)
        again = stream(rows)  # the same lane (the lowest free one), the prefix still there
        assert counts() == (1, 3, 1, 2)  # its seed found the lane as the refresh left it: nothing written
        assert (graphs.fresh, caches.batcher.lanes.fresh) == (0, 1)  # taken on the stream's thread, no turn
        # the same values in a writable array: not known equal without a look, which a turn takes
        looked = stream(rows, conv.copy())
        assert counts() == (1, 5, 2, 3) and (graphs.fresh, caches.batcher.lanes.fresh) == (1, 1)
        stream(None)  # a stream without a saved voice writes from frame 0, over the prefix (no refresh)
        third = stream(rows)
        assert counts() == (2, 6, 2, 4)
        stream(PrefixRows(rows.host.copy()))  # another voice's rows (equal values, another prefix)
        assert counts() == (3, 7, 2, 5)
        for got in (again, looked, third):
            for a, b in zip(got, first, strict=True):
                np.testing.assert_array_equal(a, b)


def test_a_preload_is_queued_and_the_lanes_first_window_waits_for_it(static_flow_bundle: Path) -> None:
    """A stream opens its ten Euler steps' lanes before its LLM prefill is submitted: preload queues
    the seed on the graph thread and returns (each awaited in turn waited behind other streams'
    replays); the lane's first window runs after it and gives what an awaited seed gives. A seed
    that fails fails every use of the lane, and an unused lane whose seed failed still goes back."""
    with _one_group(static_flow_bundle, seed=12, windows=2) as (sessions, caches, spec, graphs, thread, chunk, rows,
                                                               conv, feeds):

        def stream(busy: bool) -> list[np.ndarray]:
            cache = caches(sessions["flow_estimator"], spec)
            assert isinstance(cache, BatchedStepCache)
            release = threading.Event()
            blocker = thread.submit(release.wait) if busy else None
            seeds_before = graphs.seeds + graphs.reuses
            cache.preload(rows, conv)
            if busy:
                assert graphs.seeds + graphs.reuses == seeds_before  # returned with the thread still busy
                release.set()
                assert blocker is not None and blocker.result(timeout=30)
            assert cache.length == 2 * chunk
            out = [cache.run(f, chunk) for f in feeds]
            cache.close()
            return out

        awaited = stream(busy=False)
        queued = stream(busy=True)
        for a, b in zip(queued, awaited, strict=True):
            np.testing.assert_array_equal(a, b)

        failing = PrefixRows(rows.host.copy())  # another prefix: a full seed, which fails here
        real_seed = graphs.seed

        def broken(slot: int, prefix: PrefixRows, history: np.ndarray) -> None:
            raise RuntimeError("seed copy failed")
        graphs.seed = broken  # type: ignore[method-assign]
        try:
            used = caches(sessions["flow_estimator"], spec)
            used.preload(failing, conv)
            for _ in range(2):  # at every use, not only the first
                with pytest.raises(RuntimeError, match="seed copy failed"):
                    used.run(feeds[0], chunk)
            used.close()
            unused = caches(sessions["flow_estimator"], spec)
            unused.preload(failing, conv)
            unused.close()
        finally:
            graphs.seed = real_seed  # type: ignore[method-assign]
        assert caches.batcher.lanes.in_use == 0


def bundle_with_voice(src: Path, tmp_path: Path) -> Path:
    """A copy of `src` with the saved voice "alice" (4 s: several complete flow chunks, a transcript)."""
    import shutil

    import soundfile as sf
    from cosyedge_daemon.cli.voice import add_voice

    from tests.models.synthesis.test_synthesizer import prompt_audio

    bundle = tmp_path / "bundle"
    shutil.copytree(src, bundle)
    prompt = prompt_audio(4.0, 22050)
    sf.write(tmp_path / "alice.wav", prompt.pcm, prompt.sample_rate)
    add_voice(bundle, "alice", tmp_path / "alice.wav", "Hello, this is Alice speaking, slowly and clearly.")
    return bundle


def test_a_prepared_voice_is_in_every_lane_before_its_first_stream(static_flow_bundle: Path, tmp_path: Path) -> None:
    """prepare_voice (the daemon's default voice at start, bench --voice) seeds the saved voice's flow
    prefix into every free lane of every Euler step's group, so its first streams seed nothing (at
    eight cold streams on the H200 their 70 seeds took 1.2 s of the graph thread) and hear the same;
    a voice without a recording has no prefix to seed."""
    bundle = bundle_with_voice(static_flow_bundle, tmp_path)

    def audio(eng: CosyVoiceSynthesizer) -> np.ndarray:
        request = SynthesisRequest(text=TEXTS[0], mode="zero_shot", voice="alice", seed=3, stream=True)
        return np.concatenate([c.pcm for c in eng.synthesize(request)])

    plain = load_synthesizer(bundle, "ort", _settings(True))
    try:
        want = audio(plain)  # its lanes seeded by the stream itself
        assert plain.graphs.flow_batch is not None and plain.graphs.flow_batch.graphs.seeds > 0
    finally:
        plain.close()
    eng = load_synthesizer(bundle, "ort", _settings(True))
    try:
        batcher = eng.graphs.flow_batch
        assert batcher is not None
        graphs = batcher.graphs
        assert eng.prepare_voice("alice") == graphs.slots == graphs.groups * graphs.lanes
        assert graphs.seeds == graphs.slots and batcher.lanes.in_use == 0
        got = audio(eng)
        batcher.thread.call(lambda: None)  # after the lanes' refreshes at the stream's end (lanes.py)
        # the stream's seeds found its lanes as prepare_voice left them and took them so on its own thread
        # (no turn); at its end its lanes got the voice's conv history again
        assert graphs.seeds == graphs.slots and (batcher.lanes.fresh, batcher.lanes.refreshes) == (graphs.groups,) * 2
        assert graphs.fresh == 0 and graphs.reuses == graphs.groups
        sft_only = next(n for n in eng.bundle.voices if n != "alice")
        assert eng.prepare_voice(sft_only) == 0 and graphs.seeds == graphs.slots
        with pytest.raises(RequestError, match="unknown voice 'nobody'"):
            eng.prepare_voice("nobody")
    finally:
        eng.close()
    # with the batched encoder windows: the voice's encoder prefix in every encoder lane too
    encoders_on = dataclasses.replace(_settings(True), graph_encoder=True, graph_encoder_batch=True)
    eng = load_synthesizer(bundle, "ort", encoders_on)
    try:
        encoders = eng.graphs.encoder_batch
        assert encoders is not None and eng.prepare_voice("alice") > 0
        with_encoders = audio(eng)
        assert (encoders.stats.fresh, encoders.stats.refreshes, encoders.stats.rows > 0) == (1, 1, True)
    finally:
        eng.close()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(with_encoders, want, rtol=0, atol=1e-4)


def test_a_stream_behind_catches_up_and_then_shares_each_euler_step(static_flow_bundle: Path) -> None:
    """Stream A waits at Euler step 2 of 4 when B starts at step 0: B's steps run first (A waits,
    lowest step first) and steps 2 and 3 serve both in one replay each (served oldest first, the
    two never met: each replay served one); each stream's rows equal the same stream alone."""
    groups = 4
    with _lanes(static_flow_bundle, groups=groups) as (sessions, bundle, _, single, graphs, thread):
        batcher = FlowBatcher(graphs, thread)
        batcher.partner_wait_s = 60.0  # a loaded CI machine must not split the pair by timing
        caches = BatchedFlowCaches(batcher, single, single)
        chunk = int(bundle.manifest["stages"][f"{STATIC_FLOW_PREFIX}{STATIC_FLOW_WINDOWS[0]}"]["chunk_frames"])
        channels = int(sessions["flow_estimator"].input_shapes["x"][1])
        rng = np.random.default_rng(5)
        feeds = {s: [_feeds(rng, channels, STATIC_FLOW_WINDOWS[0]) for _ in range(groups)] for s in "AB"}

        def steps(stream: str) -> list[BatchedStepCache]:
            made = [caches(sessions["flow_estimator"],
                           StepCacheSpec(single.row, single.conv, np.dtype(np.float32), euler_step=k))
                    for k in range(groups)]
            assert all(isinstance(c, BatchedStepCache) and c.on_graph for c in made)
            return [c for c in made if isinstance(c, BatchedStepCache)]

        def alone(stream: str) -> list[np.ndarray]:
            made = steps(stream)
            out = [c.run(f, chunk) for c, f in zip(made, feeds[stream], strict=True)]
            for c in made:
                c.close()
            return out

        want = {s: alone(s) for s in "AB"}
        before = batcher.report()
        got: dict[str, list[np.ndarray]] = {"A": [], "B": []}
        made = {s: steps(s) for s in "AB"}
        go = threading.Event()
        errors: list[BaseException] = []

        def run(stream: str, pause_at: int | None) -> None:
            try:
                for k, (c, f) in enumerate(zip(made[stream], feeds[stream], strict=True)):
                    if k == pause_at:
                        go.wait(60)
                    got[stream].append(c.run(f, chunk))
            except BaseException as exc:  # reported below
                errors.append(exc)

        a = threading.Thread(target=run, args=("A", 2))
        a.start()
        deadline = time.monotonic() + 60
        while len(got["A"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)

        def hold() -> None:  # until A's step 2 and B's step 0 both wait
            while batcher.waiting < 2 and time.monotonic() < deadline:
                time.sleep(0.01)

        held = thread.submit(hold)
        go.set()
        b = threading.Thread(target=run, args=("B", None))
        b.start()
        held.result(60)
        for t in (a, b):
            t.join(120)
        assert not errors, errors
        after = batcher.report()
        assert after["replays"] == int(before["replays"]) + 6  # A 0, 1; B 0, 1; both 2, 3
        assert after["shared_replays"] == int(before["shared_replays"]) + 2
        for s in "AB":
            for c in made[s]:
                c.close()
            for g, w in zip(got[s], want[s], strict=True):
                np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * float(np.abs(w).max()))


def test_lanes_that_fail_to_capture_leave_the_engine_serving_without_them(
        static_flow_bundle: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A GPU the sizing misjudged (the nineteenth run's H100: out of memory in the lanes' warm-up) still
    loads an engine: the lanes are freed and their sessions closed, a warning says why, and the streams
    run on the single-stream slots with the same audio as an engine without graph_flow_batch."""
    closed: list[int] = []
    real_close = BatchFlowGraphs.close

    def fail(self: BatchFlowGraphs) -> None:
        raise SynthesisError("flow_estimator_batch_b1_w64: onnxruntime failed: CUDA failure 2: out of memory")

    def close(self: BatchFlowGraphs) -> None:
        closed.append(self.lanes)
        real_close(self)

    monkeypatch.setattr(BatchFlowGraphs, "warm_up", fail)
    monkeypatch.setattr(BatchFlowGraphs, "close", close)
    with caplog.at_level("WARNING", logger="cosyedge_models.synthesis.graph_stages"):
        eng = load_synthesizer(static_flow_bundle, "ort", _settings(True))
    try:
        assert eng.graphs.flow_batch is None and closed
        assert any("graph_flow_batch: off, capturing" in r.getMessage() and "out of memory" in r.getMessage()
                   for r in caplog.records)
        got = _audio(eng, 0)
    finally:
        eng.close()  # the lanes' sessions closed early close again without error
    plain = load_synthesizer(static_flow_bundle, "ort", _settings(False))
    try:
        np.testing.assert_allclose(got, _audio(plain, 0), rtol=0, atol=1e-4)
    finally:
        plain.close()


def test_the_seeds_waiting_for_the_graph_thread_are_written_in_one_turn(static_flow_bundle: Path) -> None:
    """A stream opens its Euler steps' lanes at once; their seeds waiting when the graph thread comes to
    them are written in one turn (BatchFlowGraphs.seed_many), and where the lanes still hold the voice's
    prefix, their conv histories in one upload and one copy run (a seed each took ~1.2 ms of the graph
    thread on the H200). At the streams' end the lanes get the voice's conv history again (lanes.py), so
    the next streams' seeds write nothing. Each lane then gives what a lane seeded alone gives."""
    with _one_group(static_flow_bundle, seed=13, windows=1) as (sessions, caches, spec, graphs, thread, chunk, rows,
                                                               conv, feeds):
        turns: list[int] = []
        real = graphs.seed_many

        def counted(items: list[tuple[int, PrefixRows, np.ndarray]]) -> None:
            turns.append(len(items))
            real(items)

        graphs.seed_many = counted  # type: ignore[method-assign]
        copies: list[int] = []
        real_copy = graphs.copier.copy_many

        def copy_many(items: list[tuple[int, int, int]]) -> None:
            if items:  # (a turn's resets: none)
                copies.append(len(items))
            real_copy(items)

        graphs.copier.copy_many = copy_many  # type: ignore[method-assign]
        lanes = graphs.lanes
        assert lanes >= 2

        def behind_other_work(work: Callable[[], object]) -> None:
            release = threading.Event()
            blocker = thread.submit(release.wait)  # what `work` queues waits behind other work
            work()
            release.set()
            assert blocker.result(timeout=30)
            thread.call(lambda: None)

        def open_every_lane() -> list[np.ndarray]:
            opened: list[StepCache] = []

            def open_them() -> None:
                opened.extend(caches(sessions["flow_estimator"], spec) for _ in range(lanes))
                assert all(isinstance(c, BatchedStepCache) and c.on_graph for c in opened)
                for cache in opened:
                    cache.preload(rows, conv)

            behind_other_work(open_them)
            outs = [cache.run(feeds[0], chunk) for cache in opened]
            behind_other_work(lambda: [cache.close() for cache in opened])
            return outs

        first = open_every_lane()  # every lane seeded in full, in one turn; at the end refreshed, in one turn
        assert turns == [lanes, lanes] and (graphs.seeds, graphs.reuses, graphs.fresh) == (lanes, lanes, 0)
        assert copies[-1:] == [lanes]  # the refresh: every lane's conv history in one copy run
        written = len(copies)
        again = open_every_lane()  # every lane as its refresh left it: the seeds took them so, without a turn
        assert turns == [lanes] * 3 and (graphs.seeds, graphs.reuses, graphs.fresh) == (lanes, 2 * lanes, 0)
        assert caches.batcher.lanes.fresh == lanes
        assert copies[written:] == [lanes]  # only the second refresh copied
        for a, b in zip([*first[1:], *again], [first[0]] * (2 * lanes - 1), strict=True):
            np.testing.assert_array_equal(a, b)  # the lanes' streams wrote their own histories


def test_a_lane_taken_during_its_refresh_is_the_new_streams_alone(static_flow_bundle: Path) -> None:
    """A lane given back by a stream of a saved voice is refreshed in a queued turn (lanes.py). A new
    stream that takes it first drops that refresh (without a voice it zeroes the lane at its first use),
    and one that takes it while the refresh is written waits for it: either way its length is 0 and it
    gives what a stream without a voice gives on a lane no one used."""
    with _one_group(static_flow_bundle, seed=15, windows=2) as (sessions, caches, spec, graphs, thread, chunk, rows,
                                                               conv, feeds):
        lanes = caches.batcher.lanes

        def plain(cache: StepCache | None = None) -> list[np.ndarray]:
            cache = cache or caches(sessions["flow_estimator"], spec)
            assert isinstance(cache, BatchedStepCache) and cache.length == 0
            out = [cache.run(f, chunk) for f in feeds]
            cache.close()
            return out

        alone = plain()
        thread.call(lambda: None)  # its lane zeroed at its end, in a queued turn
        assert (lanes.zeroings, lanes.dropped) == (1, 0)
        voiced = caches(sessions["flow_estimator"], spec)
        voiced.preload(rows, conv)
        voiced.run(feeds[0], chunk)
        release = threading.Event()
        blocker = thread.submit(release.wait)
        voiced.close()  # its refresh queued behind other work
        new = caches(sessions["flow_estimator"], spec)  # the same lane, taken first: the refresh dropped
        assert (lanes.refreshes, lanes.dropped) == (1, 1)
        release.set()
        assert blocker.result(timeout=30)
        voiced_then_plain = plain(new)
        thread.call(lambda: None)  # its end's zeroing written

        # the refresh being written when the new stream takes the lane: acquire waits for it
        writing, go_on = threading.Event(), threading.Event()
        real = graphs.seed_many

        def slow(items: list[tuple[int, PrefixRows | None, np.ndarray | None]]) -> None:
            if any(prefix is not None for _, prefix, _ in items) and not go_on.is_set():
                writing.set()
                assert go_on.wait(30)
            real(items)

        graphs.seed_many = slow  # type: ignore[method-assign]
        cache = caches(sessions["flow_estimator"], spec)
        cache.preload(rows, conv)
        go_on.set()  # its own seed goes on at once
        cache.run(feeds[0], chunk)
        go_on.clear()
        cache.close()
        assert writing.wait(30)  # the refresh's turn holds the graph thread
        taken: list[list[np.ndarray]] = []
        taker = threading.Thread(target=lambda: taken.append(plain()))
        taker.start()
        taker.join(0.3)
        assert taker.is_alive()  # waiting for the refresh being written
        go_on.set()
        taker.join(60)
        graphs.seed_many = real  # type: ignore[method-assign]
        assert (lanes.refreshes, lanes.dropped, lanes.in_use) == (2, 1, 0)
        for got in (voiced_then_plain, taken[0]):
            for a, b in zip(got, alone, strict=True):
                np.testing.assert_array_equal(a, b)


def test_a_lane_is_given_back_ready_for_the_next_stream_like_its_own(static_flow_bundle: Path) -> None:
    """A stream without a saved voice gives its lane back zeroed in a queued turn at its end, so the next
    such stream writes nothing before its first window; a stream of a saved voice gives it back refreshed,
    and the voice's next stream there takes it on its own thread with the graph thread busy (a turn that
    wrote nothing waited up to 84 ms for the GIL on the H100). A stream without a voice on a lane the voice
    left zeroes it at its first window, on that window's thread. Each gives what it gives on a fresh lane."""
    with _one_group(static_flow_bundle, seed=14, windows=2) as (sessions, caches, spec, graphs, thread, chunk, rows,
                                                               conv, feeds):
        lanes = caches.batcher.lanes
        resets: list[str] = []
        real = graphs.reset_many

        def counted(slots: list[int]) -> None:
            if slots:
                resets.append(threading.current_thread().name)
            real(slots)

        graphs.reset_many = counted  # type: ignore[method-assign]

        def stream(voice: bool, busy: bool = False) -> list[np.ndarray]:
            release = threading.Event()
            blocker = thread.submit(release.wait) if busy else None
            cache = caches(sessions["flow_estimator"], spec)
            assert isinstance(cache, BatchedStepCache)
            if voice:
                cache.preload(rows, conv)
            if busy:  # nothing waits for the graph thread: the lane is ready as it was given back
                assert cache.length == (2 * chunk if voice else 0)
                release.set()
                assert blocker is not None and blocker.result(timeout=30)
            out: list[np.ndarray] = []
            runner = threading.Thread(target=lambda: out.extend(cache.run(f, chunk) for f in feeds),
                                      name="first-window")
            runner.start()
            runner.join(60)
            cache.close()
            thread.call(lambda: None)  # its end's write (zeros or the voice's history) done
            return out

        first = stream(voice=False)  # the lane as the graphs made it: zero, nothing written before its use
        assert len(resets) == 1
        assert lanes.zeroings == 1 and resets[0] not in ("MainThread", "first-window")  # at its end, in a turn
        again = stream(voice=False, busy=True)  # the lane its end zeroed: nothing to write
        assert lanes.zeroings == 2 and len(resets) == 2
        voiced = stream(voice=True)  # seeded in a turn, refreshed at its end
        assert (lanes.refreshes, lanes.zeroings, len(resets)) == (1, 2, 2)
        voiced_again = stream(voice=True, busy=True)  # taken as the refresh left it: no turn
        assert (lanes.fresh, lanes.refreshes) == (1, 2)
        after_voice = stream(voice=False)  # the voice's history there: zeroed at its first window
        assert resets[2] == "first-window" and lanes.zeroings == 3
        assert lanes.in_use == 0 and lanes.dropped == 0
        for got, want in ((again, first), (after_voice, first), (voiced_again, voiced)):
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(a, b)
