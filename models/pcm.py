"""The one place audio changes sample format: float32 in [-1, 1] (what the
synthesizers produce and the speaker plays) to and from 16-bit little-endian
PCM (what MQTT, Wyoming, the cloud wire and the microphone carry), and a
mono PCM16 WAV file in memory (Hermes playBytes, VAD segments). numpy and
the standard library only."""

from __future__ import annotations

import io
import wave

import numpy as np

PCM16 = np.dtype("<i2")
_TO_PCM16 = 32767.0  # float -> PCM16: full scale is 32767 (clipped), so +1.0 does not wrap
_FROM_PCM16 = 32768.0  # PCM16 -> float: -32768 maps to exactly -1.0


def float_to_pcm16(pcm: np.ndarray) -> np.ndarray:
    """float32 samples in [-1, 1] (clipped) as PCM16 samples."""
    return (np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0) * _TO_PCM16).round().astype(PCM16)


def pcm16_bytes(pcm: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] as PCM16 little-endian bytes."""
    return float_to_pcm16(pcm).tobytes()


def pcm16_to_float(data: bytes | np.ndarray, channels: int = 1) -> np.ndarray:
    """PCM16 samples (bytes, little endian, or an int16 array) as float32 mono:
    interleaved channels are averaged; a trailing partial frame is dropped."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        samples = np.frombuffer(raw[: len(raw) - len(raw) % (2 * channels)], PCM16)
    else:
        samples = np.asarray(data, dtype=PCM16)
    pcm = samples.astype(np.float32) / _FROM_PCM16
    return pcm.reshape(-1, channels).mean(axis=1) if channels > 1 else pcm


def wav_bytes(pcm: np.ndarray | bytes, sample_rate: int) -> bytes:
    """A complete mono PCM16 WAV file in memory, of float32 samples or PCM16 (an int16 array or bytes)."""
    if isinstance(pcm, bytes):
        body = pcm
    elif np.asarray(pcm).dtype.kind == "f":
        body = pcm16_bytes(pcm)
    else:
        body = np.asarray(pcm, dtype=PCM16).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(body)
    return buf.getvalue()
