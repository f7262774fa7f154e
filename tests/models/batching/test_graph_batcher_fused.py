"""The iteration-level batcher over the fused batched step (FusedDecodeStep,
one graph per batch size over one in-place KV buffer) on the CPU: seeded
streams joining and leaving at chosen rounds give the same tokens as each
stream through the same batcher alone, and the steps really share graphs."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.backends.graph_thread import GraphThread
from cosyedge_models.backends.ort import OrtSession
from cosyedge_models.batching.fused_step import FusedDecodeStep
from cosyedge_models.batching.graph_batcher import GraphBatcher
from cosyedge_models.batching.iteration import IterationSettings
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.llm import LlmInput
from cosyedge_models.synthesis.sampling import TokenSampler
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer

from tests.conftest import FUSED_DECODE_BATCHES
from tests.support.module_tmp import ModuleTmp

POSITIONS = 256
TEXTS = ["Hello world one two.", "A quick fox", "A", "Numbers today"]


@pytest.fixture(scope="module")
def fused_dir(tiny_model_dir: Path, module_tmp: ModuleTmp) -> Path:
    from cosyedge_build.export.llm_fused import export_fused_decode
    from cosyedge_build.reference.modules import load_reference

    out = module_tmp.mktemp("fused")
    export_fused_decode(load_reference(tiny_model_dir).llm, out, [1, 2, 4], POSITIONS)
    return out


def _session(name: str, path: Path) -> OrtSession:
    return OrtSession(name, path, ["CPUExecutionProvider"], 0, 1)


def _fused(fused_dir: Path, tiny_bundle: Path) -> FusedDecodeStep:
    """The fused step of batch sizes 1, 2, 4 over 4 rows, on the CPU."""
    steps = {b: _session(f"fused{b}", fused_dir / f"llm_decode_fused_b{b}.onnx") for b in (1, 2, 4)}
    return FusedDecodeStep(steps, _session("insert", fused_dir / "llm_fused_kv_insert.onnx"),
                           _session("llm_prefill", tiny_bundle / "llm_prefill.onnx"), ("cpu", 0), rows=4)


def _run(engine: CosyVoiceSynthesizer, batcher: GraphBatcher,
         joins: dict[int, list[tuple[int, int]]]) -> dict[int, list[int]]:
    """Submit (text, seed) pairs before round r; rounds until every stream is done; each seed's tokens."""
    lm, streams, r = engine.lm, {}, 0
    while r <= max(joins) or batcher.active or batcher.waiting:
        for i, seed in joins.get(r, ()):
            sampler = TokenSampler.seeded(lm.config.sampling, lm.config.eos_token, seed)
            streams[seed] = batcher.submit(LlmInput(text=engine.tokenizer.encode(TEXTS[i])), sampler)
        batcher.run_once()
        r += 1
    return {seed: list(s) for seed, s in streams.items()}


def test_fused_batches_give_each_stream_its_tokens_alone(engine: CosyVoiceSynthesizer, fused_dir: Path,
                                                         tiny_bundle: Path) -> None:
    lm = engine.lm
    fused = _fused(fused_dir, tiny_bundle)
    with GraphThread() as thread:
        thread.call(fused.warm_up)
        settings = IterationSettings(BatchSettings(max_batch_size=4), fused.batch_sizes, 4, 1)
        batcher = GraphBatcher(lm, fused, thread, settings)

        run = functools.partial(_run, engine, batcher)

        schedule = {0: [(0, 1)], 2: [(1, 2)], 4: [(2, 3), (3, 4)]}
        alone = {seed: run({0: [(i, seed)]})[seed] for group in schedule.values() for i, seed in group}
        alone_steps = batcher.stats.steps
        together = run(schedule)
    assert all(alone.values()) and together == alone
    assert batcher.stats.shared_steps > 0 and batcher.stats.steps - alone_steps < alone_steps
    assert batcher.stats.peak_batch >= 3


def test_the_engine_batches_on_the_bundles_fused_step(fused_bundle: Path) -> None:
    """graph_batching with a bundle that has the fused step graphs: the engine's batcher runs on
    FusedDecodeStep (no fixed-size decode needed), captured at load on the decode graph thread;
    two concurrent seeded requests give the audio each gives alone, sharing steps."""
    settings = SynthesisSettings(threads=1, graph_batching=True, batching=BatchSettings(max_batch_size=8))
    engine = load_synthesizer(fused_bundle, settings=settings)
    try:
        batcher = engine.batcher
        assert isinstance(batcher, GraphBatcher) and isinstance(batcher.step, FusedDecodeStep)
        assert engine.lm.fixed_size_decode is None and "fused_decode" in engine.graphs.load_seconds
        assert batcher.step.batch_sizes == FUSED_DECODE_BATCHES and batcher.step.kv_dtype == np.float32
        # lowered to the largest fused batch size: every stream needs a row
        assert batcher.scheduler.settings.batch.max_batch_size == FUSED_DECODE_BATCHES[-1]

        def audio(seed: int) -> np.ndarray:
            return np.concatenate([c.pcm for c in engine.synthesize(SynthesisRequest(text=TEXTS[0], seed=seed))])

        alone = {seed: audio(seed) for seed in (3, 5)}
        assert batcher.stats.shared_steps == 0
        together: dict[int, np.ndarray] = {}
        threads = [threading.Thread(target=lambda s=seed: together.__setitem__(s, audio(s))) for seed in (3, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert batcher.stats.shared_steps > 0
        for seed in (3, 5):
            assert together[seed].shape == alone[seed].shape
            np.testing.assert_allclose(together[seed], alone[seed], atol=1e-4)
    finally:
        engine.close()
    assert not batcher.step._steps  # its sessions closed with the engine


def test_a_rounds_prompts_prefill_in_one_run(engine: CosyVoiceSynthesizer, fused_dir: Path,
                                             tiny_bundle: Path) -> None:
    """llm_batched_prefill: the three prompts that join in round 0 go through one prefill run (rows 0-2),
    each row's last prompt position its first step's input; the ones that join later, one a round, are
    prefilled alone; every seeded stream gives the tokens it gives alone (prefilled alone, row by row)."""
    lm = engine.lm
    fused = _fused(fused_dir, tiny_bundle)
    with GraphThread() as thread:
        thread.call(fused.warm_up)
        settings = IterationSettings(BatchSettings(max_batch_size=4), fused.batch_sizes, 4, 4)
        batcher = GraphBatcher(lm, fused, thread, settings, batched_prefill=True)
        assert batcher.batched_prefill

        run = functools.partial(_run, engine, batcher)

        schedule = {0: [(0, 11), (1, 12), (3, 13)], 2: [(3, 14)], 5: [(1, 16)]}
        alone = {seed: run({0: [(i, seed)]})[seed] for group in schedule.values() for i, seed in group}
        assert batcher.stats.batched_prefills == 0  # one prompt a round: prefilled alone
        together = run(schedule)
    assert all(alone.values()) and together == alone
    assert batcher.stats.batched_prefills == 1 and batcher.stats.shared_steps > 0


def test_the_engine_passes_batched_prefill_to_its_batcher(fused_bundle: Path) -> None:
    settings = SynthesisSettings(threads=1, graph_batching=True, batching=BatchSettings(max_batch_size=8),
                                 llm_batched_prefill=True)
    engine = load_synthesizer(fused_bundle, settings=settings)
    try:
        assert isinstance(engine.batcher, GraphBatcher) and engine.batcher.batched_prefill
    finally:
        engine.close()
