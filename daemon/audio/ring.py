"""A bounded float32 ring buffer between a writer thread (the synthesis
pipeline, which blocks while it is full) and an audio callback (which never
waits: it takes what is there). The lock is only held for slice copies."""

from __future__ import annotations

import threading
import time

import numpy as np


class FloatRing:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._buf = np.zeros(capacity, dtype=np.float32)
        self._cap = capacity
        self._read = 0  # absolute sample counters; index = counter % capacity
        self._write = 0
        self._generation = 0  # bumped by clear(): a blocked write stops
        self._closed = False
        self._cond = threading.Condition(threading.Lock())

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def available(self) -> int:
        return self._write - self._read

    @property
    def total_read(self) -> int:
        return self._read

    def write(self, samples: np.ndarray, timeout_s: float | None = None) -> int:
        """Copy all of `samples` in, blocking while the ring is full. Returns how
        many were accepted: fewer when clear() or close() interrupted the wait,
        or the timeout passed."""
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        done = 0
        with self._cond:
            gen = self._generation
            while done < len(x):
                free = self._cap - (self._write - self._read)
                if free == 0:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if self._closed or gen != self._generation or (remaining is not None and remaining <= 0):
                        break
                    self._cond.wait(remaining)
                    if gen != self._generation or self._closed:
                        break
                    continue
                n = min(free, len(x) - done)
                start = self._write % self._cap
                first = min(n, self._cap - start)
                self._buf[start:start + first] = x[done:done + first]
                if n > first:
                    self._buf[:n - first] = x[done + first:done + n]
                self._write += n
                done += n
        return done

    def read_into(self, out: np.ndarray) -> int:
        """Copy up to len(out) samples into `out` without waiting; returns the count."""
        with self._cond:
            n = min(len(out), self._write - self._read)
            if n:
                start = self._read % self._cap
                first = min(n, self._cap - start)
                out[:first] = self._buf[start:start + first]
                if n > first:
                    out[first:n] = self._buf[:n - first]
                self._read += n
                self._cond.notify_all()
        return n

    def clear(self) -> int:
        """Drop everything queued (and stop a blocked write); returns how many samples were dropped."""
        with self._cond:
            dropped = self._write - self._read
            self._read = self._write
            self._generation += 1
            self._cond.notify_all()
        return dropped

    def wait_empty(self, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._write > self._read and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return self._write == self._read

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
