"""Request -> streamed chunks -> done, through a real Mosquitto, the bridge
and a real tritonserver running the cosyvoice2 orchestrator."""

from __future__ import annotations

import numpy as np

from cloud_bridge.protocol import CloudRequest
from tests.cloud_bridge.conftest import V1_HZ
from tests.cloud_bridge.device import Device
from tests.cloud_bridge.sine_engine import CHUNK_SAMPLES, dominant_frequency


def test_request_streams_chunks_then_done(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    make_bridge()
    device = Device(broker.url, "kitchen")
    try:
        answer = device.ask(CloudRequest(id="r1", text="hello {chunks=4}", model_version="1", seed=1))
    finally:
        device.close()
    assert answer.error is None, answer.error
    assert [a.seq for a in answer.audio] == [0, 1, 2, 3]
    assert [a.last for a in answer.audio] == [False, False, False, True]
    assert all(a.sample_rate == 24000 and len(a.pcm16) == 2 * CHUNK_SAMPLES for a in answer.audio)
    assert abs(dominant_frequency(answer.pcm(), 24000) - V1_HZ) < 15
    assert answer.done is not None
    assert answer.done.summary["chunks"] == 4
    assert answer.done.summary["model_version"] == "1"
    assert np.isclose(answer.done.summary["audio_seconds"], 0.4)
