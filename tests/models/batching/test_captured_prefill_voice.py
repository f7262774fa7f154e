"""Streams of one saved voice through the captured prefill graphs ([tts] llm_captured_prefill), as the goals'
bench runs them with its voice: the voice's LLM prefix goes into the prefill graphs' scratch row once and
serves the prompts after it there (FusedDecodeStep keeps it, a prefill writing only the positions after it),
and every stream's audio is the one the dynamic prefill gives (on the CPU, without capture)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.batching.fused_step import FusedDecodeStep
from cosyedge_models.batching.graph_batcher import GraphBatcher
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer

from tests.support.concurrent import run_concurrently
from tests.support.module_tmp import ModuleTmp
from tests.support.voices import bundle_with_voice

TEXTS = ("Hello world one two.", "A quick fox jumps.", "Numbers today")


@pytest.fixture(scope="module")
def voiced_bundle(every_graph_bundle: Path, module_tmp: ModuleTmp) -> Path:
    """every_graph_bundle with a saved 1 s voice (its prompt then fits the 64-position prefill graph)."""
    return bundle_with_voice(every_graph_bundle, module_tmp.mktemp("voiced") / "bundle", 1.0,
                             "Hello, Alice here.")


def _speak(engine: CosyVoiceSynthesizer, i: int) -> np.ndarray:
    request = SynthesisRequest(text=TEXTS[i], mode="zero_shot", voice="alice", seed=40 + i, stream=True)
    return np.concatenate([c.pcm for c in engine.synthesize(request)])


def test_a_voice_prefix_serves_every_captured_prefill_and_the_audio_is_the_dynamic_prefills(
        voiced_bundle: Path) -> None:
    audio: dict[bool, dict[int, np.ndarray]] = {}
    for captured in (False, True):
        settings = SynthesisSettings(backend="ort", threads=1, graph_flow=True, graph_vocoder=True,
                                     graph_batching=True, batching=BatchSettings(max_batch_size=4),
                                     llm_captured_prefill=captured)
        engine = load_synthesizer(voiced_bundle, settings=settings)
        try:
            batcher = engine.batcher
            assert isinstance(batcher, GraphBatcher) and isinstance(batcher.step, FusedDecodeStep)

            audio[captured] = run_concurrently(len(TEXTS), functools.partial(_speak, engine))
            if captured:
                # every prompt through the captured graphs, after the one prefix: put in once, then kept
                assert batcher.stats.captured_prefills == len(TEXTS)
                assert batcher.step.prefix_reuses == len(TEXTS) - 1
            else:
                assert batcher.stats.captured_prefills == 0 and batcher.step.prefix_reuses == 0
        finally:
            engine.close()
    for i in range(len(TEXTS)):
        got, want = audio[True][i], audio[False][i]
        assert got.shape == want.shape and want.size > 0
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
