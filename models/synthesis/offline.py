"""What only offline (stream=false) requests need: the mel resized for `speed`, and a segment's
streamed pieces joined into one (an offline request served as a stream, `offline_as_stream`)."""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import numpy as np

Pieces = Generator[tuple[np.ndarray, bool], None, None]  # (pcm, final) of one segment


def linear_resize(mel: np.ndarray, frames: int) -> np.ndarray:
    """torch F.interpolate(mode='linear', align_corners=False) along the last axis."""
    src = mel.shape[-1]
    pos = (np.arange(frames, dtype=np.float64) + 0.5) * (src / frames) - 0.5
    pos = np.clip(pos, 0, src - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, src - 1)
    w = (pos - lo).astype(np.float32)
    return (mel[..., lo] * (1 - w) + mel[..., hi] * w).astype(np.float32)


def joined(pieces: Pieces) -> Pieces:
    """A segment's streamed pieces as its one final piece (closed here when the consumer stops)."""
    with contextlib.closing(pieces):
        parts = [pcm for pcm, _ in pieces]
    yield (np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)), True
