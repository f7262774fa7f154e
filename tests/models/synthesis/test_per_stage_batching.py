"""The configurations the H200 plan measures (edge_build/tools/device_plan.sh), on the CPU without
capture: the fused batched LLM step, the batched estimator windows and the fixed-length vocoder, each
on its own graph thread (graph_threads "per-stage") with a round's prefills at once
(llm_parallel_prefills) or in one prefill run (llm_batched_prefill, the three requests as one group,
as a Triton batch arrives), give the audio of the one-thread engine with prefills one after another;
the first chunks hold the flow and vocoder threads, and the LLM step's only for a stream alone in the LLM.
The streams' encoder calls in
one batched replay (graph_encoder_batch) give that audio too, and so do the prompts through the
fixed-length prefill graphs (llm_captured_prefill) on the LLM's graph thread."""

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


def test_per_stage_threads_and_parallel_or_batched_prefills_give_the_one_thread_audio(every_graph_bundle: Path) -> None:
    audio: dict[str, dict[int, np.ndarray]] = {}
    configs = {"one": ("one", 1, False, False, False), "per-stage": ("per-stage", STREAMS, False, False, False),
               "batched": ("per-stage", 1, True, False, False), "encoder": ("one", 1, False, True, False),
               "captured": ("per-stage", 1, False, False, True)}
    for name, (mode, prefills, batched, encoder, captured) in configs.items():
        settings = SynthesisSettings(backend="ort", threads=1, graph_flow=True, graph_vocoder=True,
                                     graph_batching=True, batching=BatchSettings(max_batch_size=4),
                                     graph_flow_batch=True, graph_threads=mode, llm_parallel_prefills=prefills,
                                     llm_batched_prefill=batched, graph_encoder_batch=encoder,
                                     llm_captured_prefill=captured)
        engine = load_synthesizer(every_graph_bundle, settings=settings)
        try:
            batcher, flow = engine.batcher, engine.graphs.flow_batch
            assert isinstance(batcher, GraphBatcher) and isinstance(batcher.step, FusedDecodeStep)
            assert flow is not None and engine.static_vocoder is not None
            threads = dict(engine.graphs.threads)
            assert set(threads) == {"decode", "flow", "vocoder"}
            if batched:
                with engine.request_group(STREAMS, 60):  # all three join one round: one prefill run
                    audio[name] = _concurrently(engine)
                assert batcher.stats.batched_prefills == 1
            else:
                audio[name] = _concurrently(engine)
                assert batcher.stats.batched_prefills == 0
            # every prompt through the captured prefill graphs, on the decode thread, where asked
            assert batcher.captured_prefill == captured
            assert batcher.stats.captured_prefills == (STREAMS if captured else 0)
            holds = {stage: t.order_stats()["holds"] for stage, t in threads.items()}
            assert batcher.stats.shared_steps > 0 and flow.stats.replays > 0
            assert engine.static_vocoder.replays > 0
            encoders = engine.graphs.encoder_batch
            assert (encoders is not None and encoders.stats.rows > 0) == encoder
            # the single-stream encoder slots: one per single-stream flow request, plus one per flow lane
            # unless the encoder lanes serve those streams
            single = max(1, engine.graphs.flow.max_slots // engine.bundle.flow.n_timesteps)
            assert engine.static_encoder is not None
            assert engine.static_encoder.max_slots == single + (0 if encoder else flow.graphs.lanes)
            if mode == "one":
                assert len({id(t) for t in threads.values()}) == 1 and holds["decode"] == STREAMS
            else:
                assert len({id(t) for t in threads.values()}) == 3
                # the LLM step's thread is held only for a first chunk whose stream was the LLM's only one
                assert holds == {"decode": engine.graphs.lone_holds, "flow": STREAMS, "vocoder": STREAMS}, holds
        finally:
            engine.close()
    for name in ("per-stage", "batched", "encoder", "captured"):
        for i in range(STREAMS):
            got, want = audio[name][i], audio["one"][i]
            assert got.shape == want.shape and want.size > 0
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_per_stage_threads_hold_the_llm_thread_for_a_stream_alone(every_graph_bundle: Path) -> None:
    """A lone stream's first chunk holds the LLM step's thread too (its own later tokens wait, as on one
    thread, instead of sharing the GPU with its first chunk's replays); with other streams in the LLM, or
    where the LLM's streams are not known, the hold leaves the LLM step's thread alone."""
    settings = SynthesisSettings(backend="ort", threads=1, graph_flow=True, graph_vocoder=True, graph_batching=True,
                                 batching=BatchSettings(max_batch_size=4), graph_flow_batch=True,
                                 graph_threads="per-stage")
    engine = load_synthesizer(every_graph_bundle, settings=settings)
    try:
        threads = dict(engine.graphs.threads)

        def held(llm_streams: int | None) -> set[str]:
            return {stage for stage, t in threads.items() if t in engine.graphs.first_audio_threads(llm_streams)}

        assert held(1) == {"decode", "flow", "vocoder"}
        assert held(2) == held(None) == {"flow", "vocoder"}
        request = SynthesisRequest(text=TEXTS[0], seed=70, stream=True)
        alone = np.concatenate([c.pcm for c in engine.synthesize(request)])
        holds = {stage: t.order_stats()["holds"] for stage, t in threads.items()}
        assert holds == {"decode": 1, "flow": 1, "vocoder": 1} and engine.graphs.lone_holds == 1
    finally:
        engine.close()
    one = load_synthesizer(every_graph_bundle, settings=SynthesisSettings(
        backend="ort", threads=1, graph_flow=True, graph_vocoder=True, graph_batching=True,
        batching=BatchSettings(max_batch_size=4), graph_flow_batch=True, graph_threads="one"))
    try:  # the same audio as the one thread's (the hold orders work, it changes no result)
        np.testing.assert_array_equal(alone, np.concatenate([c.pcm for c in one.synthesize(request)]))
        assert one.graphs.lone_holds == 0  # one thread: every hold takes the LLM's steps, none is counted
    finally:
        one.close()
