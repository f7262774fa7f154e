"""The product path: the cosyvoice2 Triton model (the orchestrator over the
tiny bundle through cosyedge_models.synthesis.synthesizer.load_synthesizer) behind the bridge. The cloud
audio must be the audio the local engine makes for the same request."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from cosyedge_cloud.wire.protocol import CloudPrompt, CloudRequest
from cosyedge_models.pcm import pcm16_bytes
from cosyedge_models.synthesis.api import PromptAudio, SynthesisRequest

from tests.cloud_bridge.device import Device
from tests.cloud_bridge.helpers import settled_metric
from tests.support.waiting import wait_until

PRODUCT = {"model": "cosyvoice2", "first_chunk_timeout_s": 120.0, "chunk_timeout_s": 120.0}


def _local_chunks(bundle: Path, request: SynthesisRequest) -> list[bytes]:
    from cosyedge_models.synthesis.synthesizer import load_synthesizer

    engine = load_synthesizer(bundle)
    try:
        return [pcm16_bytes(c.pcm) for c in engine.synthesize(request)]
    finally:
        engine.close()


def _max_lsb(a: bytes, b: bytes) -> int:
    x, y = np.frombuffer(a, "<i2").astype(np.int32), np.frombuffer(b, "<i2").astype(np.int32)
    assert x.shape == y.shape
    return int(np.abs(x - y).max(initial=0))


def test_cloud_audio_equals_the_local_engines(broker, make_bridge, tiny_bundle) -> None:  # type: ignore[no-untyped-def]
    bridge = make_bridge(triton=PRODUCT)
    device = Device(broker.url, "kitchen")
    text = "Hello from the cloud."
    try:
        answer = device.ask(CloudRequest(id="real", text=text, seed=11, model_version="1"), timeout_s=180)
    finally:
        device.close()
    assert answer.done is not None, answer.error
    assert answer.done.summary["model_version"] == "1"
    assert {a.sample_rate for a in answer.audio} == {24000}
    assert [a.seq for a in answer.audio] == list(range(len(answer.audio))) and answer.audio[-1].last
    times = answer.done.summary["times"]
    assert times["llm_tokens"] > 0 and times["first_audio_ms"] is not None
    local = _local_chunks(tiny_bundle, SynthesisRequest(text=text, seed=11))
    assert [len(c) for c in local] == [len(a.pcm16) for a in answer.audio]
    # same engine code, same seed: the same audio (up to float noise between processes)
    assert max(_max_lsb(x, a.pcm16) for x, a in zip(local, answer.audio, strict=True)) <= 2
    assert bridge.metrics.value("cosyedge_bridge_requests_total", version="1", outcome="done") == 1


def test_real_engine_errors_reach_the_device(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    make_bridge(triton=PRODUCT)
    device = Device(broker.url, "kitchen")
    try:
        voice = device.ask(CloudRequest(id="v", text="hi", voice="nobody"), timeout_s=60)
        speed = device.ask(CloudRequest(id="s", text="hi", speed=1.5, stream=True), timeout_s=60)
    finally:
        device.close()
    assert voice.error is not None and voice.error.code == "unknown_voice" and "nobody" in voice.error.message
    assert speed.error is not None and speed.error.code == "bad_speed"
    assert not voice.audio and not speed.audio


def test_zero_shot_prompt_reaches_the_engine(broker, make_bridge, tiny_bundle) -> None:  # type: ignore[no-untyped-def]
    make_bridge(triton=PRODUCT)
    device = Device(broker.url, "kitchen")
    rng = np.random.default_rng(0)
    pcm = 0.3 * np.sin(np.arange(16000) * 2 * np.pi * 180 / 16000) + 0.02 * rng.standard_normal(16000)
    pcm = pcm.astype(np.float32)
    prompt = CloudPrompt(pcm, 16000, "a reference voice")
    try:
        answer = device.ask(
            CloudRequest(id="zs", text="Clone this.", mode="zero_shot", prompt=prompt, seed=3, stream=False),
            timeout_s=180,
        )
    finally:
        device.close()
    if not any(tiny_bundle.glob("speech_tokenizer*.onnx")):
        # this bundle cannot tokenize a prompt: the device learns it cannot be served here
        assert answer.error is not None and answer.error.code == "unsupported", answer.error
        assert "speech_tokenizer" in answer.error.message
        return
    assert answer.done is not None, answer.error
    # the wire carries PCM16: quantize the local prompt the same way
    wire = np.frombuffer(pcm16_bytes(pcm), "<i2").astype(np.float32) / 32768.0
    local = _local_chunks(
        tiny_bundle,
        SynthesisRequest(
            text="Clone this.",
            mode="zero_shot",
            seed=3,
            stream=False,
            prompt=PromptAudio(wire, 16000, "a reference voice"),
        ),
    )
    assert len(local) == len(answer.audio)
    assert max(_max_lsb(x, a.pcm16) for x, a in zip(local, answer.audio, strict=True)) <= 2


def test_dynamic_batching_on_the_real_model(broker, make_bridge, triton) -> None:  # type: ignore[no-untyped-def]
    make_bridge(triton=PRODUCT, limits={"max_in_flight": 8})
    device = Device(broker.url, "kitchen")
    labels = {"model": "cosyvoice2", "version": "2"}
    try:
        req0 = settled_metric(triton, "nv_inference_request_success", **labels)
        exec0 = settled_metric(triton, "nv_inference_exec_count", **labels)
        answers = [device.send(CloudRequest(id=f"b{i}", text="Hi.", seed=i, model_version="2")) for i in range(4)]
        assert all(a.finished.wait(240) for a in answers)
        requests = settled_metric(triton, "nv_inference_request_success", **labels) - req0
        executions = settled_metric(triton, "nv_inference_exec_count", **labels) - exec0
    finally:
        device.close()
    assert all(a.done is not None for a in answers), [a.error for a in answers]
    assert requests == 4
    assert executions < requests  # Triton handed the orchestrator batches of more than one request


def test_a_triton_batch_decodes_as_one_engine_batch(broker, make_bridge, tiny_bundle) -> None:  # type: ignore[no-untyped-def]
    """A long request holds the model instance (its `execute` runs until it is
    done) while five more arrive: Triton hands those five to one `execute`. The four good ones start their LLM
    decode together (the engine's statistics say so, not the clock), each
    answer is the one the engine gives alone, and the bad one fails alone."""
    make_bridge(triton=PRODUCT, limits={"max_in_flight": 8})
    device = Device(broker.url, "kitchen")
    texts = {f"g{i}": f"Batched request number {i} says hello." for i in range(4)}
    try:
        blocker = device.send(CloudRequest(id="blocker", text="A long text that keeps the model busy. " * 6,
                                           seed=1, model_version="1"))
        wait_until(lambda: len(blocker.audio) > 0, 120)  # its execute runs
        answers = {rid: device.send(CloudRequest(id=rid, text=text, seed=40 + i, model_version="1"))
                   for i, (rid, text) in enumerate(texts.items())}
        bad = device.send(CloudRequest(id="bad", text="hi", voice="nobody", model_version="1"))
        assert all(a.finished.wait(240) for a in (blocker, bad, *answers.values()))
    finally:
        device.close()
    assert bad.error is not None and bad.error.code == "unknown_voice"
    assert all(a.done is not None for a in answers.values()), [a.error for a in answers.values()]
    times = {rid: a.done.summary["times"] for rid, a in answers.items()}  # type: ignore[union-attr]
    assert {t.get("triton_batch") for t in times.values()} == {5}, times  # one execute: four good, one bad
    assert {t["llm_batch_max"] for t in times.values()} == {4}, times  # four streams in one decode step
    from cosyedge_models.synthesis.synthesizer import load_synthesizer

    engine = load_synthesizer(tiny_bundle)
    try:
        for i, (rid, text) in enumerate(texts.items()):
            local = [pcm16_bytes(c.pcm) for c in engine.synthesize(SynthesisRequest(text=text, seed=40 + i))]
            got = answers[rid].audio
            assert [len(c) for c in local] == [len(a.pcm16) for a in got]
            assert max(_max_lsb(x, a.pcm16) for x, a in zip(local, got, strict=True)) <= 2
    finally:
        engine.close()
