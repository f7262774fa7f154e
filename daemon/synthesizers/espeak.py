"""The fallback voice: espeak-ng run as a subprocess, one process per
sentence, resampled with soxr to the daemon's output rate. It implements
`cosyedge_models.synthesis.api.Synthesizer`, so the daemon treats it like any other engine."""

from __future__ import annotations

import logging
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Iterator

import numpy as np
import soxr
from cosyedge_models.errors import RequestError, SynthesisError
from cosyedge_models.pcm import pcm16_to_float
from cosyedge_models.synthesis.api import AudioChunk, Mode, StageTimes, SynthesisRequest, SynthesizerDefaults
from cosyedge_models.text.split import is_only_punctuation, split_paragraph

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a running espeak-ng process checks the cancel flag
_MAX_SENTENCE_CHARS = 400  # a longer sentence is cut (at a pause mark or a space) so no chunk grows unbounded


def _chars(text: str) -> range:
    return range(len(text))


def sentence_chunks(text: str, max_chars: int = _MAX_SENTENCE_CHARS) -> list[str]:
    """The text cut into sentences for per-sentence streaming (the models' one
    splitter, lengths in characters, no merging; a cut piece may gain the closing mark); text of
    punctuation only stays one chunk."""
    chunks: list[str] = []
    for part in split_paragraph(text, _chars, "other", 0, 0, 0, max_segment_n=max_chars):
        part = part.strip()
        if chunks and is_only_punctuation(part):
            chunks[-1] += part  # e.g. the terminal mark the splitter adds after a cut
        elif part:
            chunks.append(part)
    return chunks or [text.strip()]


def pcm_from_wav_stream(data: bytes) -> tuple[np.ndarray, int]:
    """PCM16 mono samples and the rate of the WAV espeak-ng writes to stdout.
    Its header carries placeholder sizes (it streams), so the data chunk is
    taken to run to the end of the output."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise SynthesisError("espeak-ng did not write a WAV stream")
    pos, rate = 12, 0
    while pos + 8 <= len(data):
        tag, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if tag == b"fmt ":
            channels, rate = struct.unpack_from("<HI", data, pos + 10)
            bits = struct.unpack_from("<H", data, pos + 22)[0]
            if channels != 1 or bits != 16:
                raise SynthesisError(f"espeak-ng wrote {channels} channels of {bits} bits, expected mono PCM16")
        elif tag == b"data":
            body = data[pos + 8 :]
            body = body[: len(body) // 2 * 2]
            if rate == 0:
                raise SynthesisError("espeak-ng WAV stream has no fmt chunk")
            return np.frombuffer(body, dtype="<i2"), rate
        pos += 8 + size
    raise SynthesisError("espeak-ng WAV stream has no data chunk")


def list_espeak_voices(binary: str) -> list[str]:
    """The language/voice names `-v` accepts (mbrola voices excluded: they
    need the separate mbrola binary and data)."""
    out = subprocess.run([binary, "--voices"], capture_output=True, text=True, timeout=10, check=False)
    names: set[str] = set()
    for line in out.stdout.splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 5 and not cols[4].startswith("mb/"):
            names.add(cols[1])
    return sorted(names)


class EspeakSynthesizer(SynthesizerDefaults):
    """espeak-ng as an Synthesizer. Thread-safe: each call runs its own processes."""

    name = "espeak-ng"

    def __init__(
        self,
        voice: str = "en-us",
        rate_wpm: int = 175,
        sample_rate: int = 24000,
        binary: str = "espeak-ng",
        sentence_timeout_s: float = 30.0,
    ) -> None:
        path = shutil.which(binary)
        if path is None:
            raise SynthesisError(
                f"the fallback voice needs '{binary}', which is not installed: "
                "apt-get install espeak-ng (or set [fallback] enabled = false)"
            )
        self.binary = path
        self.sample_rate = sample_rate
        self.rate_wpm = rate_wpm
        self.sentence_timeout_s = sentence_timeout_s
        self._voices = list_espeak_voices(path)
        if voice not in self._voices:
            raise SynthesisError(f"espeak-ng has no voice '{voice}'; installed: {', '.join(self._voices)}")
        self.default_voice = voice

    def voices(self) -> list[str]:
        return list(self._voices)

    def modes(self) -> tuple[Mode, ...]:
        return ("sft",)

    def validate(self, request: SynthesisRequest) -> None:
        if request.mode not in self.modes():
            raise RequestError(
                "unsupported_mode", f"espeak-ng supports mode 'sft' only, not '{request.mode}'"
            )
        if request.voice is not None and request.voice not in self._voices:
            raise RequestError(
                "unknown_voice",
                f"unknown voice '{request.voice}'; espeak-ng voices: {', '.join(self._voices)}",
            )
        if not request.text.strip():
            raise RequestError("invalid_field", "text is empty")

    def synthesize(
        self, request: SynthesisRequest, cancel: threading.Event | None = None
    ) -> Iterator[AudioChunk]:
        self.validate(request)
        cancel = cancel or threading.Event()
        voice = request.voice or self.default_voice
        rate = max(80, min(500, round(self.rate_wpm * request.speed)))
        sentences = sentence_chunks(request.text) if request.stream else [request.text.strip()]
        times = StageTimes()
        start = time.perf_counter()
        for index, sentence in enumerate(sentences):
            if cancel.is_set():
                return
            t0 = time.perf_counter()
            pcm16, rate_in = self._run(sentence, voice, rate, cancel)
            if pcm16 is None:
                return
            audio = pcm16_to_float(pcm16)
            if rate_in != self.sample_rate and audio.size:
                audio = soxr.resample(audio, rate_in, self.sample_rate).astype(np.float32)
            times.vocoder_ms += (time.perf_counter() - t0) * 1000.0
            if times.first_audio_ms is None:
                times.first_audio_ms = (time.perf_counter() - start) * 1000.0
            last = index == len(sentences) - 1
            yield AudioChunk(
                pcm=audio,
                sample_rate=self.sample_rate,
                index=index,
                last=last,
                times=StageTimes(**vars(times)),
            )

    def _run(
        self, text: str, voice: str, rate: int, cancel: threading.Event
    ) -> tuple[np.ndarray | None, int]:
        # Text goes through stdin (-b 1: UTF-8), never argv: no option injection, no length limit.
        proc = subprocess.Popen(
            [self.binary, "--stdout", "-b", "1", "-v", voice, "-s", str(rate)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + self.sentence_timeout_s
        payload: bytes | None = text.encode("utf-8")
        try:
            while True:
                try:
                    out, err = proc.communicate(payload, timeout=_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    payload = None  # already handed over; a retry must not resend it
                    if cancel.is_set():
                        return None, 0
                    if time.monotonic() > deadline:
                        raise SynthesisError(
                            f"espeak-ng took over {self.sentence_timeout_s} s for one sentence"
                        ) from None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0 or b"Error" in err:
            raise SynthesisError(
                f"espeak-ng failed (exit {proc.returncode}): {err.decode(errors='replace').strip()}"
            )
        return pcm_from_wav_stream(out)

    def close(self) -> None:
        """Nothing to release: processes live only for one sentence."""
