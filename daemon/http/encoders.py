"""The response formats, each an incremental encoder: PCM16 mono in as the
engine produces it, bytes out as soon as the format allows. `pcm` is the
samples as they are (16-bit little-endian), `wav` the same behind a header
whose sizes say "unknown" (the length is not known when it is sent, as in
OpenAI's own streamed WAV); `flac`, `mp3` and `opus` (in Ogg) are
libsndfile's encoders through soundfile. Pure logic: no I/O here."""

from __future__ import annotations

import io
import struct
from typing import Protocol

import numpy as np
import soundfile as sf
from cosyedge_daemon.http.errors import HttpError

CONTENT_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg",
                 "opus": "audio/ogg"}
# format -> (libsndfile major format, subtype)
_SNDFILE = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
_UNKNOWN_SIZE = 0xFFFFFFFF


class Encoder(Protocol):
    # The largest piece encoded at once (0: any): a compressing encoder takes a while over a long chunk,
    # and its first frames can be on their way meanwhile.
    slice_bytes: int

    def encode(self, pcm16: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


class PcmEncoder:
    slice_bytes = 0

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate

    def encode(self, pcm16: bytes) -> bytes:
        return pcm16

    def finish(self) -> bytes:
        return b""


def wav_header(sample_rate: int, channels: int = 1, width: int = 2) -> bytes:
    """A RIFF/WAVE header for PCM16 of unknown length (sizes 0xFFFFFFFF)."""
    return (b"RIFF" + struct.pack("<I", _UNKNOWN_SIZE) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * channels * width,
                                    channels * width, width * 8)
            + b"data" + struct.pack("<I", _UNKNOWN_SIZE))


class WavEncoder(PcmEncoder):
    def __init__(self, sample_rate: int) -> None:
        super().__init__(sample_rate)
        self._header: bytes | None = wav_header(sample_rate)

    def encode(self, pcm16: bytes) -> bytes:
        head, self._header = self._header or b"", None
        return head + pcm16

    def finish(self) -> bytes:
        head, self._header = self._header or b"", None  # no audio at all: still a well-formed file
        return head


class _Outbox(io.RawIOBase):
    """The file libsndfile writes into, read out as it grows. What was sent
    cannot change: a write below that point (a header libsndfile rewrites at
    close, e.g. FLAC's total length) is dropped, which those formats allow
    (unknown length)."""

    def __init__(self) -> None:
        self._sent = 0  # bytes handed out
        self._pending = bytearray()  # bytes from _sent on
        self._pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        n = len(data)
        start, view = self._pos, memoryview(data)
        if start < self._sent:
            view = view[min(self._sent - start, n):]
            start = self._sent
        offset = start - self._sent
        if offset > len(self._pending):
            self._pending.extend(bytes(offset - len(self._pending)))
        self._pending[offset:offset + len(view)] = view
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        end = self._sent + len(self._pending)
        self._pos = {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset, io.SEEK_END: end + offset}[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        start = max(self._pos - self._sent, 0)
        data = bytes(self._pending[start:] if size < 0 else self._pending[start:start + size])
        self._pos += len(data)
        return data

    def take(self) -> bytes:
        data, self._pending = bytes(self._pending), bytearray()
        self._sent += len(data)
        return data


class SndfileEncoder:
    slice_bytes = 4800  # 0.1 s at 24 kHz: an mp3 frame is 576 samples, Opus' 20 ms, FLAC's block 4096

    def __init__(self, fmt: str, sample_rate: int) -> None:
        major, subtype = _SNDFILE[fmt]
        if not sf.check_format(major, subtype):
            raise HttpError("unsupported_format", f"response_format '{fmt}' needs a libsndfile with {major} "
                            f"{subtype} (soundfile's own wheel has it); use wav, flac or pcm", "response_format")
        if fmt == "opus" and sample_rate not in OPUS_RATES:
            raise HttpError("unsupported_format", f"opus cannot carry {sample_rate} Hz audio; use wav, flac or pcm",
                            "response_format")
        self._out = _Outbox()
        self._file = sf.SoundFile(self._out, "w", samplerate=sample_rate, channels=1, format=major,
                                  subtype=subtype)

    def encode(self, pcm16: bytes) -> bytes:
        self._file.write(np.frombuffer(pcm16, "<i2"))
        return self._out.take()

    def finish(self) -> bytes:
        self._file.close()
        return self._out.take()


def make_encoder(fmt: str, sample_rate: int) -> Encoder:
    """HttpError (unsupported_format) when this machine's libsndfile lacks the format."""
    if fmt == "pcm":
        return PcmEncoder(sample_rate)
    if fmt == "wav":
        return WavEncoder(sample_rate)
    return SndfileEncoder(fmt, sample_rate)
