"""Mel to waveform with HiFT, offline or in streaming chunks.

Streaming follows upstream `CosyVoice2Model.token2wav`: each chunk's mel is
prefixed with the last `mel_cache_len` frames of the previous chunk, the
harmonic source of those frames is reused (so the excitation is continuous),
the first `source_cache_len` samples are cross-faded with the previous
chunk's held-back tail (Hamming window), and the last `source_cache_len`
samples are held back until the next chunk or the end. The cache lives in a
`VocoderStream` per request, never on the shared instance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.bundle.loader import Bundle


class NoiseSource(Protocol):
    def standard_normal(self, size: tuple[int, ...], dtype: type[np.float32]) -> np.ndarray: ...


def crossfade(head: np.ndarray, prev_tail: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Mix the first half-window of `head` with `prev_tail` (upstream
    `fade_in_out`): head * rising half + tail * falling half."""
    n = window.shape[0] // 2
    out = head.copy()
    out[..., :n] = head[..., :n] * window[:n] + prev_tail[..., -n:] * window[n:]
    return out


class FixedLengthVocoder(Protocol):
    """Both vocoder stages for some chunk lengths in one call
    (models/backends/ort_static_vocoder.py); None where it has no graph."""

    frames: list[int]  # the chunk lengths (mel frames) it has graphs for

    def run(self, mel: np.ndarray, noise: np.ndarray, cache: np.ndarray | None) -> tuple[
        np.ndarray, np.ndarray] | None: ...


class HiftVocoder:
    def __init__(self, bundle: Bundle, source: Session, decoder: Session,
                 static: FixedLengthVocoder | None = None, pad_final: bool = False) -> None:
        self.source_session = source
        self.decoder_session = decoder
        self.static = static  # the fixed-length graphs where a chunk's length has one
        # a stream's last chunk, of any length, right-padded into a fixed-length graph (padded_run)
        self.pad_final = pad_final and static is not None
        self.upsample = bundle.hift.upsample_factor
        self.harmonics = bundle.hift.harmonics
        self.mel_cache_len = bundle.streaming.mel_cache_len
        self.source_cache_len = bundle.streaming.source_cache_len
        self.window = np.hamming(2 * self.source_cache_len).astype(np.float32)
        self.mel_bins = bundle.mel_bins

    def warm_up(self, frames: Sequence[int]) -> None:
        """One call at each mel length before any request: sessions kept on one
        shape (ShapePinnedSession) then serve those lengths set up, where the
        CUDA provider's convolutions cost 150-200 ms at a shape new to them."""
        for n in frames:
            mel = np.zeros((1, self.mel_bins, n), np.float32)
            draws = np.zeros((1, n * self.upsample, self.harmonics), np.float32)
            source = self.source_session.run({"mel": mel, "noise": draws})["source"]
            self.decoder_session.run({"mel": mel, "source": source})

    def run(self, mel: np.ndarray, noise: NoiseSource, cache_source: np.ndarray | None = None,
            final: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(audio [1, frames * U], source [1, 1, frames * U]) for mel [1, C, frames]; `final`: a
        stream's last chunk (padded into a fixed-length graph where pad_final allows)."""
        frames = mel.shape[2]
        mel = np.ascontiguousarray(mel, dtype=np.float32)
        draws = noise.standard_normal((1, frames * self.upsample, self.harmonics), np.float32)
        if self.static is not None and (out := self.static.run(mel, draws, cache_source)) is not None:
            return out
        if final and self.pad_final and (out := self.padded_run(mel, draws, cache_source)) is not None:
            return out
        source = self.source_session.run({"mel": mel, "noise": draws})["source"]
        if cache_source is not None and cache_source.shape[2]:
            source = source.copy()
            source[:, :, :cache_source.shape[2]] = cache_source
        audio = self.decoder_session.run({"mel": mel, "source": source})["audio"]
        return audio, source

    def padded_run(self, mel: np.ndarray, draws: np.ndarray, cache_source: np.ndarray | None) -> tuple[
            np.ndarray, np.ndarray] | None:
        """A last chunk through the shortest fixed-length graph that holds it, its mel right-padded
        with its last frame (the noise with zeros), the output cut back to its frames; None where
        none holds it. On the CUDA provider a dynamic call at a length new to its convolutions costs
        150-200 ms a graph (H200), and a stream's last chunk has any length. HiFT's convolutions are
        not causal, so the padding reaches the chunk's last frames: they differ a little from the
        exact length's (tests/models/synthesis/test_vocoder_pad_final.py measures by how much)."""
        static = self.static
        if static is None:
            return None
        n = mel.shape[2]
        for frames in (f for f in static.frames if f > n):
            padded = np.pad(mel, ((0, 0), (0, 0), (0, frames - n)), mode="edge")
            noise = np.pad(draws, ((0, 0), (0, (frames - n) * self.upsample), (0, 0)))
            if (out := static.run(padded, noise, cache_source)) is not None:
                audio, source = out
                return audio[:, :n * self.upsample], source[:, :, :n * self.upsample]
        return None


@dataclass
class VocoderStream:
    """Per-request streaming state of the vocoder."""

    vocoder: HiftVocoder
    noise: NoiseSource
    mel: np.ndarray | None = None
    source: np.ndarray | None = None
    speech: np.ndarray | None = None

    def push(self, mel: np.ndarray, final: bool) -> np.ndarray:
        """Vocode the next chunk's mel [1, C, frames]; returns the samples that
        are final now (1-D float32)."""
        v = self.vocoder
        if self.mel is not None:
            mel = np.concatenate([self.mel, mel], axis=2)
        audio, source = v.run(mel, self.noise, self.source, final=final)
        if self.speech is not None:
            audio = crossfade(audio, self.speech, v.window)
        if final:
            self.mel = self.source = self.speech = None
            return audio[0]
        self.mel = mel[:, :, -v.mel_cache_len:]
        self.source = source[:, :, -v.source_cache_len:]
        self.speech = audio[:, -v.source_cache_len:]
        return audio[0, :-v.source_cache_len]
