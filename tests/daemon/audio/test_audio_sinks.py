"""Sinks, sources and the ring buffer without a sound card (the sounddevice
layer on a virtual JACK device is in test_audio_jack.py)."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from cosyedge_daemon.audio.devices import create_sink, create_source
from cosyedge_daemon.audio.pcm import AudioFileError, Framer, read_pcm16_16k
from cosyedge_daemon.audio.ring import FloatRing
from cosyedge_daemon.audio.sinks import NullSink, WavFileSink
from cosyedge_daemon.audio.sources import ArraySource
from cosyedge_daemon.settings.audio import AudioSettings, VadSettings
from cosyedge_models.pcm import wav_bytes


def test_ring_wraps_around_and_keeps_order() -> None:
    ring = FloatRing(10)
    out = np.zeros(10, np.float32)
    for start in range(0, 60, 7):
        assert ring.write(np.arange(start, start + 7, dtype=np.float32)) == 7
        assert ring.read_into(out[:7]) == 7
        assert out[:7].tolist() == list(range(start, start + 7))
    assert ring.read_into(out) == 0 and ring.total_read == 63


def test_ring_write_blocks_until_read_and_clear_releases_it() -> None:
    ring = FloatRing(100)
    accepted: list[int] = []
    writer = threading.Thread(target=lambda: accepted.append(ring.write(np.ones(250, np.float32))))
    writer.start()
    time.sleep(0.1)
    assert writer.is_alive() and ring.available == 100  # blocked: back-pressure
    out = np.zeros(100, np.float32)
    assert ring.read_into(out) == 100
    time.sleep(0.1)
    assert writer.is_alive() and ring.available == 100
    assert ring.clear() == 100
    writer.join(timeout=2)
    assert not writer.is_alive() and accepted == [200]  # the rest was dropped by clear()
    assert ring.wait_empty(0.1)
    assert ring.write(np.ones(150, np.float32), timeout_s=0.05) == 100


def test_null_sink_paced_like_a_speaker() -> None:
    sink = NullSink(16000, paced=True, buffer_ms=100)
    t0 = time.monotonic()
    sink.write(np.zeros(4800, np.float32))  # 300 ms with a 100 ms buffer: returns after ~200 ms
    assert time.monotonic() - t0 > 0.15
    assert sink.playing
    assert sink.drain(timeout_s=2) and not sink.playing
    sink.write(np.zeros(1600, np.float32))
    sink.flush()
    assert not sink.playing
    unpaced = NullSink(24000)
    unpaced.write(np.zeros(24000 * 60, np.float32))  # immediate
    assert not unpaced.playing and unpaced.drain(0) and unpaced.samples_written == 24000 * 60


def test_wav_sink_writes_what_it_gets_with_gain(tmp_path: Path) -> None:
    x = (0.5 * np.sin(np.arange(24000) / 10)).astype(np.float32)
    sink = create_sink(AudioSettings(output_device=f"wav:{tmp_path / 'out.wav'}"), 24000)
    assert isinstance(sink, WavFileSink)
    sink.start()
    sink.write(x[:12000])
    sink.set_gain(0.5)
    sink.write(x[12000:])
    assert sink.drain()
    sink.close()
    y, rate = sf.read(tmp_path / "out.wav", dtype="float32")
    assert rate == 24000 and len(y) == 24000
    np.testing.assert_allclose(y[:12000], x[:12000], atol=1e-4)
    np.testing.assert_allclose(y[12000:], 0.5 * x[12000:], atol=1e-4)


def test_factory_none_and_wav(tmp_path: Path) -> None:
    assert isinstance(create_sink(AudioSettings(output_device="none"), 24000), NullSink)
    assert create_source(AudioSettings(input_device="none")) is None
    assert create_source(AudioSettings(capture=False)) is None
    path = tmp_path / "in.wav"
    sf.write(path, np.zeros(48000 * 2, np.int16), 48000)  # 48 kHz: resampled to 16 kHz
    src = create_source(AudioSettings(input_device=f"wav:{path}"), VadSettings(frame_ms=20))
    assert isinstance(src, ArraySource) and src.frame_ms == 20 and len(src._pcm) == 32000


def test_array_source_frames_and_times() -> None:
    pcm = np.arange(16000, dtype=np.int16)
    frames: list[tuple[bytes, float]] = []
    src = ArraySource(pcm, frame_ms=20, realtime=False)
    src.start(lambda f, t: frames.append((f, t)))
    assert src.finished.wait(5)
    src.stop()
    assert len(frames) == 50 and all(len(f) == 640 for f, _ in frames)
    assert frames[1][1] == pytest.approx(0.02) and np.frombuffer(frames[1][0], np.int16)[0] == 320
    realtime = ArraySource(np.zeros(16000, np.int16), frame_ms=30, realtime=True)
    got: list[float] = []
    t0 = time.monotonic()
    realtime.start(lambda f, t: got.append(t))
    assert realtime.finished.wait(5)
    realtime.stop()
    assert time.monotonic() - t0 > 0.9 and len(got) == 33


def test_pcm_helpers(tmp_path: Path) -> None:
    framer = Framer(4)
    assert framer.push(b"\x00" * 6) == [] and len(framer.push(b"\x01" * 12)) == 2
    data = wav_bytes(np.arange(100, dtype=np.int16), 16000)
    y, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 16000 and y.tolist() == list(range(100))
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not a wav")
    with pytest.raises(AudioFileError, match="not a readable audio file"):
        read_pcm16_16k(bad)
    with pytest.raises(AudioFileError, match="no such file"):
        read_pcm16_16k(tmp_path / "missing.wav")
