"""The configuration the H200 plan measures next (edge_build/tools/device_plan.sh, steps p and q), on
the CPU without capture: the fused batched LLM step, the batched estimator windows and the fixed-length
vocoder, each on its own graph thread (graph_threads "per-stage") with a round's prefills at once
(llm_parallel_prefills), give the audio of the one-thread engine with prefills one after another; the
first chunks hold the flow and vocoder threads, never the LLM step's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from cosyedge_models.batching.fused_step import FusedDecodeStep
from cosyedge_models.batching.graph_batcher import GraphBatcher
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer

from tests.support.concurrent import run_concurrently

TEXTS = ("Hello world one two.", "A quick fox jumps.", "Numbers today")
STREAMS = len(TEXTS)


def _concurrently(engine: CosyVoiceSynthesizer) -> dict[int, np.ndarray]:
    def one(i: int) -> np.ndarray:
        request = SynthesisRequest(text=TEXTS[i], seed=70 + i, stream=True)
        return np.concatenate([c.pcm for c in engine.synthesize(request)])

    return run_concurrently(STREAMS, one)


def test_per_stage_threads_and_parallel_prefills_give_the_one_thread_audio(every_graph_bundle: Path) -> None:
    audio: dict[str, dict[int, np.ndarray]] = {}
    for mode, prefills in (("one", 1), ("per-stage", STREAMS)):
        settings = SynthesisSettings(backend="ort", threads=1, graph_flow=True, graph_vocoder=True,
                                     graph_batching=True, batching=BatchSettings(max_batch_size=4),
                                     graph_flow_batch=True, graph_threads=mode, llm_parallel_prefills=prefills)
        engine = load_synthesizer(every_graph_bundle, settings=settings)
        try:
            batcher, flow = engine.batcher, engine.graphs.flow_batch
            assert isinstance(batcher, GraphBatcher) and isinstance(batcher.step, FusedDecodeStep)
            assert flow is not None and engine.static_vocoder is not None
            threads = engine.graph_threads
            assert set(threads) == {"decode", "flow", "vocoder"}
            audio[mode] = _concurrently(engine)
            holds = {stage: t.order_stats()["holds"] for stage, t in threads.items()}
            assert batcher.stats.shared_steps > 0 and flow.stats.replays > 0
            assert engine.static_vocoder.replays > 0
            if mode == "one":
                assert len({id(t) for t in threads.values()}) == 1 and holds["decode"] == STREAMS
            else:
                assert len({id(t) for t in threads.values()}) == 3
                assert holds == {"decode": 0, "flow": STREAMS, "vocoder": STREAMS}, holds
        finally:
            engine.close()
    for i in range(STREAMS):
        got, want = audio["per-stage"][i], audio["one"][i]
        assert got.shape == want.shape and want.size > 0
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
