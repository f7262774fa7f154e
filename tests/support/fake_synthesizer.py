"""An Synthesizer for the concurrency tests (cosyedge_models.synthesis.api.Synthesizer protocol): each
request yields `chunks` chunks of a constant level chosen per text (so the
played audio tells whose it was), records what it saw (priority, overlap
with other requests, cancel) and can be held inside synthesis until the test
releases it, or made to fail. No timing assumptions: tests wait on its events."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from cosyedge_models.errors import SynthesisError
from cosyedge_models.synthesis.api import AudioChunk, Mode, SynthesisRequest, SynthesizerDefaults


@dataclass
class Seen:
    """What the engine saw of one request."""

    priority: int
    produced: int = 0
    cancelled: bool = False
    entered: threading.Event = field(default_factory=threading.Event)
    left: threading.Event = field(default_factory=threading.Event)


class FakeSynthesizer(SynthesizerDefaults):
    name = "fake"
    sample_rate = 24000

    def __init__(self, chunks: int = 3, chunk_s: float = 0.05, levels: dict[str, float] | None = None,
                 together: int = 0) -> None:
        self.chunks = chunks
        self.chunk_samples = int(chunk_s * self.sample_rate)
        self.levels = levels or {}
        # together > 1: each request waits (at most 10 s) until that many are inside synthesize at once
        self.barrier = threading.Barrier(together) if together > 1 else None
        self.release = threading.Event()  # requests whose text contains HOLD wait for it
        self.seen: dict[str, Seen] = {}
        self.started: list[str] = []
        self.active = 0
        self.max_active = 0
        self.closed = False
        self._lock = threading.Lock()

    def voices(self) -> list[str]:
        return []

    def modes(self) -> tuple[Mode, ...]:
        return ("sft",)

    def validate(self, request: SynthesisRequest) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def synthesize(self, request: SynthesisRequest, cancel: threading.Event | None = None) -> Iterator[AudioChunk]:
        text = request.text
        seen = Seen(request.priority)
        with self._lock:
            self.seen[text] = seen
            self.started.append(text)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        seen.entered.set()
        try:
            if self.barrier is not None:
                self.barrier.wait(10.0)
            level = self.levels.get(text, 0.1)
            for n in range(self.chunks):
                if "HOLD" in text:
                    while not self.release.wait(0.01):
                        if cancel is not None and cancel.is_set():
                            break
                if cancel is not None and cancel.is_set():
                    seen.cancelled = True
                    return
                if "FAIL" in text and n == 0:
                    raise SynthesisError(f"injected failure on {text!r}")
                seen.produced += 1
                pcm = np.full(self.chunk_samples, level, dtype=np.float32)
                yield AudioChunk(pcm, self.sample_rate, n, n == self.chunks - 1)
        finally:
            with self._lock:
                self.active -= 1
            seen.left.set()
