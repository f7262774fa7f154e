"""Audio sources without a microphone: a PCM / WAV-file source (tests, the
benchmark, boards without a microphone); the microphone is in `sd_source`.
Both deliver fixed 16 kHz mono PCM16 frames with their stream
time (seconds since capture started, counting dropped audio) to `on_frame`
from their own thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
from cosyedge_daemon.audio.interfaces import FrameCallback
from cosyedge_daemon.audio.pcm import read_pcm16_16k
from cosyedge_daemon.settings.audio import FRAME_MS_CHOICES, VAD_SAMPLE_RATE


def check_frame_ms(frame_ms: int) -> None:
    if frame_ms not in FRAME_MS_CHOICES:
        raise ValueError(f"frame_ms = {frame_ms} is invalid: allowed 10, 20, 30")


class ArraySource:
    """Plays a PCM16 16 kHz signal as a microphone would: frame by frame, in
    real time (`realtime=True`) or as fast as the consumer takes them."""

    sample_rate = VAD_SAMPLE_RATE

    def __init__(self, pcm16: np.ndarray, frame_ms: int = 30, realtime: bool = True,
                 loop: bool = False) -> None:
        check_frame_ms(frame_ms)
        self.frame_ms = frame_ms
        self._pcm = np.asarray(pcm16, dtype=np.int16).reshape(-1)
        self.realtime = realtime
        self.loop = loop
        self._stop = threading.Event()
        self.finished = threading.Event()  # set when the signal ran out (never with loop=True)
        self._thread: threading.Thread | None = None
        self.frames_sent = 0

    def start(self, on_frame: FrameCallback) -> None:
        self._stop.clear()
        self.finished.clear()
        self._thread = threading.Thread(target=self._run, args=(on_frame,), name="audio-source", daemon=True)
        self._thread.start()

    def _run(self, on_frame: FrameCallback) -> None:
        n = VAD_SAMPLE_RATE * self.frame_ms // 1000
        frame_s = self.frame_ms / 1000.0
        total = len(self._pcm) // n
        t0 = time.monotonic()
        i = 0
        while not self._stop.is_set():
            if total == 0 or (i >= total and not self.loop):
                break
            k = i % total
            if self.realtime:  # a frame exists once it has been "captured"
                delay = t0 + (i + 1) * frame_s - time.monotonic()
                if delay > 0 and self._stop.wait(delay):
                    break
            on_frame(self._pcm[k * n:(k + 1) * n].tobytes(), i * frame_s)
            self.frames_sent += 1
            i += 1
        self.finished.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    @property
    def overflows(self) -> int:
        return 0


def wav_file_source(path: str | Path, frame_ms: int = 30, realtime: bool = True,
                    loop: bool = False) -> ArraySource:
    """A source reading any WAV file (resampled to 16 kHz mono)."""
    return ArraySource(read_pcm16_16k(path), frame_ms, realtime=realtime, loop=loop)
