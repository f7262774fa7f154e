"""Audio-file and framing helpers shared by sinks, sources and the VAD:
reading any WAV as 16 kHz mono, resampling, fixed-size framing (the sample
format conversions are cosyedge_models.pcm's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
from cosyedge_daemon.settings.audio import VAD_SAMPLE_RATE
from cosyedge_models.errors import CosyEdgeError
from cosyedge_models.pcm import float_to_pcm16


class AudioFileError(CosyEdgeError):
    """An audio file cannot be read (missing, not a sound file, empty)."""


def resample(x: np.ndarray, in_rate: int, out_rate: int, quality: str = "HQ") -> np.ndarray:
    """Whole-signal resampling (files); live streams use soxr.ResampleStream."""
    if in_rate == out_rate:
        return x
    import soxr

    return np.asarray(soxr.resample(x, in_rate, out_rate, quality=quality))


def read_audio_file(path: str | Path) -> tuple[np.ndarray, int]:
    """Any file libsndfile reads, as mono float32 and its sample rate."""
    import soundfile as sf

    p = Path(path)
    if not p.is_file():
        raise AudioFileError(f"{p}: no such file")
    try:
        data, rate = sf.read(str(p), dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile's message says what is wrong with the file
        raise AudioFileError(f"{p}: not a readable audio file ({exc})") from exc
    if data.shape[0] == 0:
        raise AudioFileError(f"{p}: contains no audio")
    return data.mean(axis=1).astype(np.float32), int(rate)


def read_pcm16_16k(path: str | Path) -> np.ndarray:
    """Any WAV (any rate, any channel count) as 16 kHz mono PCM16, the VAD's format."""
    x, rate = read_audio_file(path)
    return float_to_pcm16(resample(x, rate, VAD_SAMPLE_RATE))


def iter_frames(pcm16: np.ndarray, frame_samples: int) -> Iterator[tuple[bytes, float]]:
    """Whole frames of a 16 kHz signal with their start times; a partial last frame is dropped."""
    for i in range(0, len(pcm16) - frame_samples + 1, frame_samples):
        yield pcm16[i:i + frame_samples].tobytes(), i / VAD_SAMPLE_RATE


class Framer:
    """Cuts a stream of PCM16 chunks of any size into fixed frames."""

    def __init__(self, frame_samples: int) -> None:
        self.frame_bytes = frame_samples * 2
        self._pending = bytearray()

    def push(self, chunk: bytes) -> list[bytes]:
        self._pending += chunk
        n = len(self._pending) // self.frame_bytes
        frames = [bytes(self._pending[i * self.frame_bytes:(i + 1) * self.frame_bytes]) for i in range(n)]
        del self._pending[:n * self.frame_bytes]
        return frames

    def reset(self) -> None:
        self._pending.clear()
