"""POST /v1/audio/speech through OpenAI's own client on the daemon's tiny
bundle: every response format decodes to the engine's audio (the same
samples as raw pcm for the lossless ones, the same length for mp3 and opus),
streamed and not; the models and voices listings; the request shares the
daemon's trace and metrics."""

from __future__ import annotations

import io
import json
import logging

import av
import numpy as np
import pytest

from tests.daemon.conftest import DaemonFactory
from tests.daemon.http.conftest import client, start
from tests.support.waiting import wait_for

TEXT = "Hello from the speech API, one two three."
SEED = {"seed": 7}  # the daemon's own field: the same audio for every format


def decode(data: bytes) -> tuple[int, np.ndarray]:
    """(sample rate, mono float samples) by FFmpeg's decoders (PyAV): independent of libsndfile."""
    with av.open(io.BytesIO(data)) as container:
        frames = [f for f in container.decode(audio=0)]
    rate = frames[0].sample_rate
    pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in frames]) if frames else np.zeros(0)
    if pcm.dtype.kind == "i":
        pcm = pcm / 32768.0
    return rate, pcm.astype(np.float32)


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


def test_pcm_and_wav_carry_the_same_samples(daemons: DaemonFactory, caplog: pytest.LogCaptureFixture) -> None:
    svc = start(daemons)
    c = client(svc)
    with caplog.at_level(logging.INFO, logger="cosyedge_daemon.trace"):
        raw = c.audio.speech.create(model="cosyedge", voice="alloy", input=TEXT, response_format="pcm",
                                    extra_body=SEED)
        wav = c.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="wav",
                                    extra_body=SEED)
        wait_for(lambda: sum("http-" in r.getMessage() for r in caplog.records
                             if r.name == "cosyedge_daemon.trace") >= 2)
    assert raw.response.headers["content-type"] == "audio/pcm"
    assert raw.response.headers["x-sample-rate"] == "24000"
    samples = pcm16(raw.content)
    assert samples.size > 2400 and np.abs(samples).max() > 0
    rate, decoded = decode(wav.content)
    assert rate == 24000
    assert np.array_equal(decoded, samples)
    traces = [json.loads(r.message) for r in caplog.records if r.name == "cosyedge_daemon.trace"]
    mine = [t for t in traces if t["id"].startswith("http-")]
    assert [(t["outcome"], t["route"], t["output"]) for t in mine] == [("completed", "local", "publish")] * 2
    assert mine[0]["audio_seconds"] == pytest.approx(samples.size / 24000, abs=1e-3)
    assert svc.metrics.registry.get_sample_value(
        "cosyedge_tts_requests_total", {"route": "local", "outcome": "completed"}) == 2.0


def test_models_and_voices_are_listed(daemons: DaemonFactory) -> None:
    svc = start(daemons)
    models = [m.id for m in client(svc).models.list()]
    assert "cosyedge" in models and "tts-1" in models
    voices = client(svc).get("/audio/voices", cast_to=object)
    engine_voices = svc.synthesizers.served_voices()[1]
    assert [v["id"] for v in voices["voices"]] == (engine_voices or ["default"])  # type: ignore[index]


@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus"])
def test_compressed_formats_decode_to_the_audio(daemons: DaemonFactory, fmt: str) -> None:
    svc = start(daemons)
    c = client(svc)
    samples = pcm16(c.audio.speech.create(model="cosyedge", voice="alloy", input=TEXT, response_format="pcm",
                                          extra_body=SEED).content)
    with c.audio.speech.with_streaming_response.create(model="cosyedge", voice="alloy", input=TEXT,
                                                       response_format=fmt, extra_body=SEED) as response:
        assert response.headers["content-type"] == {"flac": "audio/flac", "mp3": "audio/mpeg",
                                                    "opus": "audio/ogg"}[fmt]
        data = response.read()
    rate, decoded = decode(data)
    if fmt == "flac":  # lossless: the very samples
        assert rate == 24000 and np.array_equal(decoded, samples)
        return
    # Lossy: the same duration (mp3 adds LAME's delay of 1105 samples, the padding to its 576-sample frames
    # and the empty first frame a stream cannot rewrite: under 4 frames; Opus decodes at 48 kHz), and audio.
    seconds, expected = decoded.size / rate, samples.size / 24000
    assert rate == {"mp3": 24000, "opus": 48000}[fmt]
    assert expected - 0.001 <= seconds <= expected + 4 * 576 / 24000
    assert np.sqrt(np.mean(decoded**2)) > 0.3 * np.sqrt(np.mean(samples**2))


def test_speed_and_instructions(daemons: DaemonFactory) -> None:
    svc = start(daemons)
    c = client(svc)

    def length(**kw: object) -> int:
        return len(c.audio.speech.create(model="cosyedge", voice="alloy", input=TEXT, response_format="pcm",
                                         extra_body=SEED, **kw).content)  # type: ignore[arg-type]

    normal, fast = length(), length(speed=2.0)
    assert fast < 0.75 * normal  # the same tokens (same seed), spoken faster
    assert length(instructions="Speak cheerfully.") > 0  # the instruct mode
