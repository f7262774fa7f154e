"""The tests' one fake synthesizer (the cosyedge_models.synthesis.api.Synthesizer
protocol), a test fixture, not the product.

Each request yields `chunks` chunks; what it sounds like tells whose it was:
a constant level chosen per text (`levels`), or with `frequency_hz` a sine
tone (voice "bright" an octave up, a prompt recording sets the pitch to the
prompt's). It records what it saw (priority, overlap with other requests,
cancel) and tests wait on its events, no timing assumptions:
- a text containing HOLD waits inside synthesis until `release` is set;
- a text containing FAIL fails at its first chunk;
- directives in the text: `{chunks=N}`, `{delay_ms=M}` (before each chunk),
  `{fail_at=K}` (fail at chunk K), for the cloud tests, where the real Triton
  orchestrator (cloud_bridge/triton/orchestrator.py) loads it through its
  ENGINE_FACTORY parameter (`load_sine_synthesizer` over a `sine.json` bundle)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from cosyedge_models.errors import RequestError, SynthesisError
from cosyedge_models.synthesis.api import AudioChunk, Mode, StageTimes, SynthesisRequest, SynthesizerDefaults
from cosyedge_models.synthesis.modes import MODES

_DIRECTIVE = re.compile(r"\{(\w+)=(\d+)\}")
SINE_VOICES = ("default", "bright")
CHUNK_SAMPLES = 2400  # the sine synthesizer's chunk: 0.1 s at 24 kHz


@dataclass
class Seen:
    """What the synthesizer saw of one request."""

    priority: int
    produced: int = 0
    cancelled: bool = False
    entered: threading.Event = field(default_factory=threading.Event)
    left: threading.Event = field(default_factory=threading.Event)


class FakeSynthesizer(SynthesizerDefaults):
    name = "fake"
    sample_rate = 24000

    def __init__(self, chunks: int = 3, chunk_s: float = 0.05, levels: dict[str, float] | None = None,
                 together: int = 0, *, frequency_hz: float | None = None, voices: tuple[str, ...] = (),
                 modes: tuple[Mode, ...] = ("sft",), delay_s: float = 0.0, streams: int | None = None) -> None:
        self.chunks = chunks
        self.streams = streams  # concurrent_streams: as an engine with that many GPU stream seats says
        self.chunk_samples = int(round(chunk_s * self.sample_rate))
        self.levels = levels or {}
        self.frequency_hz = frequency_hz
        self._voices = voices
        self._modes = modes
        self.delay_s = delay_s
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
        return list(self._voices)

    def concurrent_streams(self) -> int | None:
        return self.streams

    def modes(self) -> tuple[Mode, ...]:
        return self._modes

    def validate(self, request: SynthesisRequest) -> None:
        self._check(request)

    def _check(self, request: SynthesisRequest) -> None:
        # not through validate(): tests count the validations a caller makes
        if not self._voices:
            return
        if request.voice is not None and request.voice not in self._voices:
            raise RequestError("unknown_voice", f"voice {request.voice!r} is not one of {', '.join(self._voices)}")
        if not request.text.strip():
            raise RequestError("empty_text", "text is empty")

    def close(self) -> None:
        self.closed = True

    def _pcm(self, request: SynthesisRequest, n: int) -> np.ndarray:
        if self.frequency_hz is None:
            return np.full(self.chunk_samples, self.levels.get(request.text, 0.1), dtype=np.float32)
        freq = self.frequency_hz * (2.0 if request.voice == "bright" else 1.0)
        if request.prompt is not None:  # "clone" the prompt: its pitch, so a test sees the prompt arrived
            freq = round(dominant_frequency(request.prompt.pcm, request.prompt.sample_rate))
        t = (np.arange(self.chunk_samples) + n * self.chunk_samples) / self.sample_rate
        return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)

    def synthesize(self, request: SynthesisRequest, cancel: threading.Event | None = None) -> Iterator[AudioChunk]:
        self._check(request)
        text = request.text
        opts = {k: int(v) for k, v in _DIRECTIVE.findall(text)}
        chunks = opts.get("chunks", self.chunks)
        delay_s = opts.get("delay_ms", self.delay_s * 1e3) / 1e3
        fail_at = opts.get("fail_at", 0 if "FAIL" in text else -1)
        seen = Seen(request.priority)
        with self._lock:
            self.seen[text] = seen
            self.started.append(text)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        seen.entered.set()
        started = time.perf_counter()
        times = StageTimes()
        try:
            if self.barrier is not None:
                self.barrier.wait(10.0)
            for n in range(chunks):
                if "HOLD" in text:
                    while not self.release.wait(0.01):
                        if cancel is not None and cancel.is_set():
                            break
                if cancel is not None and cancel.is_set():
                    seen.cancelled = True
                    return
                if delay_s:
                    time.sleep(delay_s)
                if n == fail_at:
                    raise SynthesisError(f"injected failure on {text!r}: told to fail at chunk {n}")
                seen.produced += 1
                if times.first_audio_ms is None:
                    times.first_audio_ms = (time.perf_counter() - started) * 1e3
                yield AudioChunk(self._pcm(request, n), self.sample_rate, n, n == chunks - 1, times=times)
        finally:
            with self._lock:
                self.active -= 1
            seen.left.set()


class GatedSynthesizer(FakeSynthesizer):
    """Yields its first chunk at once, the rest only after `gate` is set:
    proves the audio is sent as produced, not after the whole utterance."""

    def __init__(self, chunks: int = 3) -> None:
        super().__init__(chunks=chunks)
        self.gate = threading.Event()
        self.cancelled = threading.Event()

    def synthesize(self, request: SynthesisRequest, cancel: threading.Event | None = None) -> Iterator[AudioChunk]:
        with self._lock:
            self.started.append(request.text)
        for n in range(self.chunks):
            if n > 0:
                while not self.gate.wait(0.01):
                    if cancel is not None and cancel.is_set():
                        self.cancelled.set()
                        return
            yield AudioChunk(np.full(self.chunk_samples, 0.1, np.float32), self.sample_rate, n, n == self.chunks - 1)


def sine_synthesizer(frequency_hz: float) -> FakeSynthesizer:
    """The cloud tests' flavour: a sine tone, every mode, two voices, 0.1 s chunks, 20 ms apart."""
    synth = FakeSynthesizer(chunk_s=CHUNK_SAMPLES / FakeSynthesizer.sample_rate, frequency_hz=frequency_hz,
                            voices=SINE_VOICES, modes=MODES, delay_s=0.02)
    synth.name = "sine-test"
    return synth


def load_sine_synthesizer(bundle_dir: Path | str, backend: str = "ort", settings: object = None) -> FakeSynthesizer:
    config = json.loads((Path(bundle_dir) / "sine.json").read_text())
    return sine_synthesizer(float(config["frequency_hz"]))


def write_sine_bundle(path: Path, frequency_hz: float) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "sine.json").write_text(json.dumps({"frequency_hz": frequency_hz}))
    return path


def dominant_frequency(pcm: np.ndarray, sample_rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(pcm * np.hanning(len(pcm))))
    return float(np.fft.rfftfreq(len(pcm), 1.0 / sample_rate)[int(np.argmax(spectrum))])
