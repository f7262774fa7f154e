"""Sinks without a sound card: a null sink (optionally paced like a real
speaker, so that "speaking" lasts as long as the audio) and a WAV file sink.
The sounddevice sink is in `sd_sink`."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


class NullSink:
    """Discards audio. With `paced=True` it behaves like a speaker with a
    `buffer_ms` queue: `write` blocks for back-pressure, `playing` stays true
    for the duration of the audio, `drain` waits for it, `flush` ends it."""

    def __init__(self, sample_rate: int, paced: bool = False, buffer_ms: int = 500) -> None:
        self.sample_rate = sample_rate
        self.paced = paced
        self._buffer_s = buffer_ms / 1000.0
        self._play_until = 0.0  # monotonic time at which the queued audio would have been played
        self._cond = threading.Condition()
        self._gain = 1.0
        self.samples_written = 0

    def start(self) -> None:
        pass

    def write(self, pcm: np.ndarray) -> None:
        n = int(np.asarray(pcm).size)
        self.samples_written += n
        if not self.paced or n == 0:
            return
        with self._cond:
            now = time.monotonic()
            self._play_until = max(self._play_until, now) + n / self.sample_rate
            while True:  # block while more than the buffer is queued; flush() wakes us
                backlog = self._play_until - time.monotonic()
                if backlog <= self._buffer_s:
                    break
                self._cond.wait(backlog - self._buffer_s)

    def drain(self, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while (left := self._play_until - time.monotonic()) > 0:
                if deadline is not None:
                    if time.monotonic() >= deadline:
                        return False
                    left = min(left, deadline - time.monotonic())
                self._cond.wait(max(left, 0.0))
        return True

    def flush(self) -> None:
        with self._cond:
            self._play_until = 0.0
            self._cond.notify_all()

    def set_gain(self, gain: float) -> None:
        self._gain = float(gain)

    @property
    def gain(self) -> float:
        return self._gain

    @property
    def playing(self) -> bool:
        return time.monotonic() < self._play_until

    @property
    def underruns(self) -> int:
        return 0

    def close(self) -> None:
        self.flush()


class WavFileSink:
    """Writes everything to a PCM16 WAV file at `sample_rate` (gain applied;
    flush cannot take back what is already written)."""

    def __init__(self, path: str | Path, sample_rate: int, channels: int = 1) -> None:
        self.sample_rate = sample_rate
        self.path = Path(path)
        self._channels = channels
        self._file: Any = None
        self._gain = 1.0
        self._lock = threading.Lock()
        self.samples_written = 0

    def start(self) -> None:
        import soundfile as sf

        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = sf.SoundFile(str(self.path), mode="w", samplerate=self.sample_rate,
                                      channels=self._channels, subtype="PCM_16", format="WAV")

    def write(self, pcm: np.ndarray) -> None:
        x = np.clip(np.asarray(pcm, dtype=np.float32).reshape(-1) * self._gain, -1.0, 1.0)
        with self._lock:
            if self._file is None:
                self.start()
            data = x if self._channels == 1 else np.repeat(x[:, None], self._channels, axis=1)
            self._file.write(data)
            self.samples_written += len(x)

    def drain(self, timeout_s: float | None = None) -> bool:
        with self._lock:
            if self._file is not None:
                self._file.flush()
        return True

    def flush(self) -> None:
        pass

    def set_gain(self, gain: float) -> None:
        self._gain = float(gain)

    @property
    def playing(self) -> bool:
        return False

    @property
    def underruns(self) -> int:
        return 0

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
