"""The audio interfaces the daemon is written against. The real
implementations (sounddevice, WAV files, MQTT) and the test doubles for
missing hardware implement the same protocols; devices are created in one
place (`cosyedge_daemon.audio.devices`) so tests can replace them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np


class AudioSink(Protocol):
    """Where synthesized speech goes. `write` blocks while the sink's bounded
    buffer is full (back-pressure on the synthesis pipeline)."""

    sample_rate: int  # the rate the sink accepts; it resamples internally if the device differs

    def start(self) -> None: ...

    def write(self, pcm: np.ndarray) -> None:
        """Queue float32 mono samples in [-1, 1] at `sample_rate`."""
        ...

    def drain(self, timeout_s: float | None = None) -> bool:
        """Block until everything written has been played; False on timeout."""
        ...

    def flush(self) -> None:
        """Drop everything queued and not yet played (barge-in, cancel)."""
        ...

    def set_gain(self, gain: float) -> None:
        """Scale the output (1.0 normal, < 1 ducking)."""
        ...

    @property
    def playing(self) -> bool:
        """True while queued audio is being played."""
        ...

    @property
    def underruns(self) -> int: ...

    def close(self) -> None: ...


FrameCallback = Callable[[bytes, float], None]  # (PCM16 mono frame at 16 kHz, capture time in s)


class AudioSource(Protocol):
    """The microphone: calls `on_frame` from its own thread with fixed-size
    PCM16 frames; the callback must not block."""

    sample_rate: int  # 16000
    frame_ms: int  # 10, 20 or 30

    def start(self, on_frame: FrameCallback) -> None: ...

    def stop(self) -> None: ...

    @property
    def overflows(self) -> int: ...


@dataclass(frozen=True)
class VadEvent:
    kind: Literal["speech_start", "speech_end"]
    # Stream time of the detected boundary (seconds since capture started): the
    # onset of speech for speech_start, the end of the last voiced frame for
    # speech_end. The utterance audio starts pre_roll_ms before the onset.
    time_s: float
    utterance_ms: float | None = None  # for speech_end
    forced_split: bool = False  # speech_end because the utterance reached max_utterance_ms
