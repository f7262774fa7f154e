"""The fixed-length vocoder graphs batched across streams (build export --static-vocoder with
--batch-flow-sizes; models/batching/batched_vocoder.py): only static shapes; the calls of one length
that wait together run as one replay, each row (a first chunk beside later ones) getting what the
single-stream graph gives it; a lone call takes the single-stream graph; the engine's audio is the same
with them. On the CPU without capture; `-m gpu` with CUDA graphs."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.graph_thread import GraphPriority, GraphThread
from cosyedge_models.backends.ort import OrtBackend, OrtSession
from cosyedge_models.backends.ort_static_vocoder import StaticVocoder
from cosyedge_models.batching.batched_vocoder import BatchedVocoder, batch_vocoder_sessions
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.bundle.loader import BATCH_VOCODER_NAME, STATIC_VOCODER_PREFIX, load_bundle
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer

from tests.support.components import require_cuda_provider
from tests.support.concurrent import run_concurrently


def test_each_length_has_a_batched_graph_per_batch_size_with_only_fixed_shapes(every_graph_bundle: Path) -> None:
    bundle = load_bundle(every_graph_bundle)
    single = sorted(int(n[len(STATIC_VOCODER_PREFIX):]) for n in bundle.stages if n.startswith(STATIC_VOCODER_PREFIX))
    batched = sorted((int(m.group(1)), int(m.group(2))) for n in bundle.stages if (m := BATCH_VOCODER_NAME.match(n)))
    assert batched == [(b, n) for b in (2, 4) for n in single]  # --batch-flow-sizes 1,2,4: B > 1
    for b, n in batched:
        model = onnx.load(str(bundle.stages[f"hift_batch_b{b}_f{n}"].path))
        for value in [*model.graph.input, *model.graph.output]:
            dims = value.type.tensor_type.shape.dim
            assert all(d.HasField("dim_value") for d in dims) and dims[0].dim_value == b, (b, n, value.name)


def _setup(bundle_dir: Path, device: str) -> tuple[StaticVocoder, BatchedVocoder, GraphThread]:
    bundle = load_bundle(bundle_dir)
    backend = create_backend("ort" if device == "cpu" else "ort-cuda")
    assert isinstance(backend, OrtBackend)
    names = sorted(n for n in bundle.stages if n.startswith(STATIC_VOCODER_PREFIX))
    singles = [backend.load(n, bundle.stages[n].path, threads=1) for n in names]
    batched = batch_vocoder_sessions(bundle, lambda name, path: backend.load(name, path, threads=1))
    assert all(isinstance(s, OrtSession) for s in [*singles, *batched.values()])
    thread = GraphThread().start()
    where = ("cpu", 0) if device == "cpu" else ("cuda", 0)
    static = StaticVocoder(singles, where, thread)  # type: ignore[arg-type]
    static.warm_up()
    vocoder = BatchedVocoder(static, batched)  # type: ignore[arg-type]
    vocoder.warm_up()
    assert static.disabled is None and vocoder.disabled is None
    return static, vocoder, thread


def _compare(bundle_dir: Path, device: str, atol: float) -> None:
    static, vocoder, thread = _setup(bundle_dir, device)
    try:
        rng = np.random.default_rng(5)
        bins = int(load_bundle(bundle_dir).mel_bins)
        cache_len = static._io[static.frames[0]].cache_len
        long, short = static.frames[-1], static.frames[0]
        calls = []  # (mel, noise, cache): three of one length (a first chunk among them), one of another
        for frames, first in ((long, True), (long, False), (long, False), (short, False)):
            factor = static._io[frames].values["noise"].shape()[1] // frames
            harmonics = static._io[frames].values["noise"].shape()[2]
            calls.append((rng.standard_normal((1, bins, frames)).astype(np.float32),
                          rng.standard_normal((1, frames * factor, harmonics)).astype(np.float32),
                          None if first else (0.3 * rng.standard_normal((1, 1, cache_len))).astype(np.float32)))
        alone = [static.run(*c) for c in calls]
        release = threading.Event()
        blocker = thread.submit(release.wait)  # every call waits before the first turn runs
        got: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}

        def one(i: int) -> None:
            got[i] = vocoder.run(*calls[i])

        workers = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 60
        while thread.pending(GraphPriority.NORMAL) < len(calls) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread.pending(GraphPriority.NORMAL) == len(calls)  # a turn each, none run yet
        release.set()
        assert blocker.result(timeout=30)
        for w in workers:
            w.join(60)
        # the three of one length in one replay of batch size 4 (a zero row after them), the other alone
        assert vocoder.stats.as_dict() == {"replays": 1, "rows": 3, "alone": 1, "peak_batch": 3}
        for i, want in enumerate(alone):
            out = got[i]
            assert out is not None and want is not None
            for a, b in zip(out, want, strict=True):
                assert a.shape == b.shape
                np.testing.assert_allclose(a, b, atol=atol, rtol=atol)
        # a length without graphs is not served here (the dynamic pair serves it)
        odd = rng.standard_normal((1, bins, short + 3)).astype(np.float32)
        assert vocoder.run(odd, calls[0][1][:, : (short + 3)], None) is None
    finally:
        thread.close()


def test_one_lengths_chunks_waiting_together_share_a_replay_and_sound_as_alone(every_graph_bundle: Path) -> None:
    _compare(every_graph_bundle, "cpu", 1e-5)


@pytest.mark.gpu
def test_captured_batched_vocoder_rows_sound_as_alone(every_graph_bundle: Path) -> None:
    require_cuda_provider()
    _compare(every_graph_bundle, "cuda", 5e-3)  # different kernels per batch size, TF32


def test_concurrent_streams_with_the_batched_vocoder_sound_as_without(every_graph_bundle: Path) -> None:
    texts = ("Hello world one two.", "A quick fox jumps.", "Numbers today")

    def audio(batch: bool) -> tuple[dict[int, np.ndarray], dict[str, int] | None]:
        settings = SynthesisSettings(backend="ort", threads=1, graph_flow=True, graph_vocoder=True,
                                     graph_batching=True, batching=BatchSettings(max_batch_size=4),
                                     graph_flow_batch=True, graph_vocoder_batch=batch)
        engine = load_synthesizer(every_graph_bundle, settings=settings)
        try:
            assert isinstance(engine.graphs.vocoder, BatchedVocoder) == batch

            def one(i: int) -> np.ndarray:
                request = SynthesisRequest(text=texts[i], seed=70 + i, stream=True)
                return np.concatenate([c.pcm for c in engine.synthesize(request)])

            out = run_concurrently(len(texts), one)
            assert engine.static_vocoder is not None and engine.static_vocoder.replays > 0
            return out, engine.graphs.vocoder_batch_stats()
        finally:
            engine.close()

    plain, none = audio(False)
    batched, stats = audio(True)
    assert none is None and stats is not None and stats["rows"] + stats["alone"] > 0
    for i, want in plain.items():
        assert batched[i].shape == want.shape and want.size > 0
        np.testing.assert_allclose(batched[i], want, rtol=0, atol=1e-4)
