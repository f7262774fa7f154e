"""An AudioSink for tests (there is no sound card here): it "plays" the
written audio at `speed` times real time on its own thread, with the same
bounded buffer and back-pressure as a device, and keeps what it played.
A test can hold the playback (`hold`/`resume`: a device that stalls) and
wait on what was written or played (`wait`), instead of waiting a time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np


class MemorySink:
    def __init__(self, sample_rate: int = 24000, speed: float = 1.0, buffer_s: float = 0.4) -> None:
        self.sample_rate = sample_rate
        self.speed = speed
        self.capacity = int(buffer_s * sample_rate)
        self._buf: list[np.ndarray] = []
        self._buffered = 0
        self._cond = threading.Condition()
        self._gain = 1.0
        self._closed = False
        self._thread: threading.Thread | None = None
        self.played: list[np.ndarray] = []
        self.flushes = 0
        self.gains: list[float] = []
        self.written = 0  # samples written
        self._held = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._play, name="memory-sink", daemon=True)
        self._thread.start()

    def _play(self) -> None:
        block = self.sample_rate // 100  # 10 ms
        while True:
            with self._cond:
                while (not self._buf or self._held) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                head = self._buf[0]
                take, rest = head[:block], head[block:]
                if rest.size:
                    self._buf[0] = rest
                else:
                    self._buf.pop(0)
                self._buffered -= take.size
                self.played.append(take * self._gain)
                self._cond.notify_all()
            time.sleep(take.size / self.sample_rate / self.speed)

    def write(self, pcm: np.ndarray) -> None:
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        pos = 0
        with self._cond:
            while pos < pcm.size and not self._closed:
                while self._buffered >= self.capacity and not self._closed:
                    self._cond.wait(0.05)
                n = min(pcm.size - pos, self.capacity - self._buffered)
                self._buf.append(pcm[pos : pos + n])
                self._buffered += n
                self.written += n
                pos += n
                self._cond.notify_all()

    def drain(self, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._buffered > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def hold(self) -> None:
        """Stop playing (what is written stays buffered) until resume()."""
        with self._cond:
            self._held = True

    def resume(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def wait(self, predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
        """Wait until `predicate()` holds, checked whenever audio is written, played or flushed."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout_s)

    def flush(self) -> None:
        with self._cond:
            self._buf.clear()
            self._buffered = 0
            self.flushes += 1
            self._cond.notify_all()

    def set_gain(self, gain: float) -> None:
        with self._cond:
            self._gain = gain
            self.gains.append(gain)

    @property
    def playing(self) -> bool:
        return self._buffered > 0

    @property
    def underruns(self) -> int:
        return 0

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(2)

    def played_seconds(self) -> float:
        return sum(p.size for p in self.played) / self.sample_rate
