"""The one sample-format module: float32 <-> PCM16 and WAV bytes, checked
against hand-computed samples and libsndfile's own reading of the WAV."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf
from cosyedge_models.pcm import float_to_pcm16, pcm16_bytes, pcm16_to_float, wav_bytes


def test_float_to_pcm16_scales_rounds_and_clips() -> None:
    x = np.array([0.0, 1.0, -1.0, 0.5, 2.0, -3.0, 1 / 32767], dtype=np.float32)
    assert float_to_pcm16(x).tolist() == [0, 32767, -32767, 16384, 32767, -32767, 1]
    assert pcm16_bytes(np.array([1.0, -1.0], np.float32)) == b"\xff\x7f\x01\x80"  # little endian


def test_pcm16_to_float_from_bytes_and_arrays_with_channels() -> None:
    assert pcm16_to_float(b"\x00\x80\x00\x40").tolist() == [-1.0, 0.5]
    assert pcm16_to_float(np.array([16384, -16384], np.int16)).tolist() == [0.5, -0.5]
    stereo = np.array([16384, 0, -32768, 0], "<i2").tobytes() + b"\x01"  # a stray byte is dropped
    assert pcm16_to_float(stereo, channels=2).tolist() == [0.25, -0.5]


def test_wav_bytes_of_floats_and_pcm16_read_back_by_libsndfile() -> None:
    pcm = np.array([0.0, 0.5, -0.5, 1.0], np.float32)
    y, rate = sf.read(io.BytesIO(wav_bytes(pcm, 24000)), dtype="int16")
    assert rate == 24000 and y.tolist() == [0, 16384, -16384, 32767]
    y, rate = sf.read(io.BytesIO(wav_bytes(np.arange(5, dtype=np.int16), 16000)), dtype="int16")
    assert rate == 16000 and y.tolist() == [0, 1, 2, 3, 4]
    y, _ = sf.read(io.BytesIO(wav_bytes(b"\x02\x00\x03\x00", 8000)), dtype="int16")
    assert y.tolist() == [2, 3]
