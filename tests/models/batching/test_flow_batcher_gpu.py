"""The batched estimator windows captured on ort-cuda (models/batching/flow_batcher.py): four
concurrent streams whose first windows meet on the graph thread share captured replays and
give the audio each gives alone (`-m gpu`; the coordinator runs it on the device), with fp32
and with fp16 lanes, and fp16 lanes whose attention is onnxruntime's MultiHeadAttention."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer

from tests.support.components import require_cuda_provider

pytestmark = pytest.mark.gpu

STREAMS = 4
TEXT = "Hello there, this is batched flow stream number {} on the GPU."


def _audio(eng: CosyVoiceSynthesizer, i: int) -> np.ndarray:
    req = SynthesisRequest(text=TEXT.format(i), seed=20 + i, stream=True)
    return np.concatenate([c.pcm for c in eng.synthesize(req)])


LANE_BUNDLES = {"fp32": "static_flow_bundle", "fp16": "static_flow_fp16_bundle",
                "fp16-fused": "static_flow_fused_fp16_bundle"}


@pytest.mark.parametrize("lanes", sorted(LANE_BUNDLES))
def test_captured_batched_windows_share_replays_and_sound_as_alone(lanes: str, request: pytest.FixtureRequest) -> None:
    require_cuda_provider()
    # the fp16 lanes: build export --batch-flow-precision fp16 (--batch-flow-attention fused)
    static_flow_bundle: Path = request.getfixturevalue(LANE_BUNDLES[lanes])
    # the LLM and the encoder off the graph thread: only estimator windows and the vocoder replay there
    settings = SynthesisSettings(backend="ort-cuda", threads=1, graph_flow=True, graph_flow_batch=True,
                                 graph_decode=False, graph_encoder=False, graph_flow_slots=STREAMS)
    eng = load_synthesizer(static_flow_bundle, settings=settings)
    try:
        batcher = eng.graphs.flow_batch
        assert batcher is not None and batcher.graphs.lanes >= 2
        assert batcher.graphs.kv_dtype is (np.float16 if lanes.startswith("fp16") else np.float32)
        streams = min(STREAMS, batcher.graphs.lanes)
        alone = {i: _audio(eng, i) for i in range(streams)}
        assert batcher.stats.replays > 0 and batcher.stats.shared_replays == 0

        def hold() -> None:
            deadline = time.monotonic() + 120
            while batcher.waiting < streams and time.monotonic() < deadline:
                time.sleep(0.005)

        held = batcher.thread.submit(hold)
        got: dict[int, np.ndarray] = {}
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                got[i] = _audio(eng, i)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        held.result(180)
        for t in threads:
            t.join(300)
        assert not errors, errors
        stats = batcher.report()
        assert stats["shared_replays"] >= 1 and stats["peak_batch"] == streams, stats
        assert eng.static_flow is not None and eng.static_flow.disabled is None
    finally:
        eng.close()
    for i in range(streams):
        assert got[i].shape == alone[i].shape
        # not bit-equal on CUDA: cuBLAS picks other kernels (and summation orders, TF32) for a batch
        # of four rows than for one, and ten Euler steps and the vocoder carry the difference (H200,
        # run 7: max |diff| 0.018 over 98,880 samples); the same audio within 20 dB of SNR
        noise = float(np.linalg.norm(got[i] - alone[i]))
        assert noise <= 0.1 * float(np.linalg.norm(alone[i])), (i, noise)
