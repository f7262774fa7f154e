"""A test fixture, not the product: an Synthesizer (cosyedge_models.synthesis.api) that streams sine
tones, loaded by the real Triton orchestrator (cloud_bridge/triton/orchestrator.py)
through its ENGINE_FACTORY parameter, so the plumbing (Triton streaming,
batching, versions, the bridge) can be tested with timing the test controls.

The bundle directory holds `sine.json`: {"frequency_hz": 440.0}. A request's
text may carry directives (a prompt recording sets the pitch to the
prompt's): `{chunks=N}` (default 3), `{delay_ms=M}` (sleep
before each chunk, default 20), `{fail_at=K}` (raise at chunk K)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from cosyedge_models.errors import RequestError, SynthesisError
from cosyedge_models.synthesis.api import AudioChunk, Mode, StageTimes, SynthesisRequest
from cosyedge_models.synthesis.modes import MODES

_DIRECTIVE = re.compile(r"\{(\w+)=(\d+)\}")
VOICES = ("default", "bright")
CHUNK_SAMPLES = 2400  # 0.1 s at 24 kHz


class SineEngine:
    name = "sine-test"
    sample_rate = 24000

    def __init__(self, frequency_hz: float) -> None:
        self.frequency_hz = frequency_hz

    def voices(self) -> list[str]:
        return list(VOICES)

    def modes(self) -> tuple[Mode, ...]:
        return MODES

    def validate(self, request: SynthesisRequest) -> None:
        if request.voice is not None and request.voice not in VOICES:
            raise RequestError("unknown_voice", f"voice {request.voice!r} is not one of {', '.join(VOICES)}")
        if not request.text.strip():
            raise RequestError("empty_text", "text is empty")

    def synthesize(self, request: SynthesisRequest, cancel: threading.Event | None = None) -> Iterator[AudioChunk]:
        self.validate(request)
        opts = {k: int(v) for k, v in _DIRECTIVE.findall(request.text)}
        chunks, delay_s, fail_at = (
            opts.get("chunks", 3),
            opts.get("delay_ms", 20) / 1e3,
            opts.get("fail_at", -1),
        )
        freq = self.frequency_hz * (2.0 if request.voice == "bright" else 1.0)
        if request.prompt is not None:  # "clone" the prompt: its pitch, so a test sees the prompt arrived
            freq = round(dominant_frequency(request.prompt.pcm, request.prompt.sample_rate))
        started = time.perf_counter()
        times = StageTimes()
        for i in range(chunks):
            if cancel is not None and cancel.is_set():
                return
            time.sleep(delay_s)
            if i == fail_at:
                raise SynthesisError(f"sine engine told to fail at chunk {i}")
            t = (np.arange(CHUNK_SAMPLES) + i * CHUNK_SAMPLES) / self.sample_rate
            pcm = (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
            if times.first_audio_ms is None:
                times.first_audio_ms = (time.perf_counter() - started) * 1e3
            yield AudioChunk(pcm=pcm, sample_rate=self.sample_rate, index=i, last=i == chunks - 1, times=times)

    def close(self) -> None:
        pass


def load_sine_engine(bundle_dir: Path | str, backend: str = "ort", settings: object = None) -> SineEngine:
    config = json.loads((Path(bundle_dir) / "sine.json").read_text())
    return SineEngine(float(config["frequency_hz"]))


def write_sine_bundle(path: Path, frequency_hz: float) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "sine.json").write_text(json.dumps({"frequency_hz": frequency_hz}))
    return path


def dominant_frequency(pcm: np.ndarray, sample_rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(pcm * np.hanning(len(pcm))))
    return float(np.fft.rfftfreq(len(pcm), 1.0 / sample_rate)[int(np.argmax(spectrum))])
