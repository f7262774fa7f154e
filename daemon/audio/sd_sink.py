"""The speaker: a sounddevice (PortAudio) output stream fed from a bounded
ring buffer. The writer resamples (soxr, streaming) from the engine rate to
the device rate and blocks while the ring is full; the audio callback only
copies out of the ring, applies the gain and outputs silence when starved,
counting the underrun. It never waits."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
from cosyedge_daemon.audio.errors import AudioDeviceError
from cosyedge_daemon.audio.ring import FloatRing
from cosyedge_daemon.settings.audio import AudioSettings

log = logging.getLogger(__name__)


class SoundDeviceSink:
    def __init__(self, sample_rate: int, settings: AudioSettings, device: int | None = None) -> None:
        self.sample_rate = sample_rate  # what `write` takes (the engine's rate)
        self.settings = settings
        self.device = device  # PortAudio device index; None = the default output
        self.device_rate = 0
        self._stream: Any = None
        self._ring: FloatRing | None = None
        self._resampler: Any = None
        self._write_lock = threading.Lock()  # resampler state belongs to writers (write/flush/drain)
        self._block = np.zeros(0, dtype=np.float32)
        self._gain_target = 1.0
        self._gain_now = 1.0
        self._active = False  # audio was written and not yet drained or flushed
        self._draining = False
        self._starved = False
        self._underruns = 0
        self._xruns = 0
        self._callback_errors = 0
        self._finished = threading.Event()

    # --- life cycle -------------------------------------------------------
    def start(self) -> None:
        if self._stream is not None:
            return
        import sounddevice as sd

        s = self.settings
        info = sd.query_devices(self.device, "output")
        rate = s.output_rate_hz or int(round(float(info["default_samplerate"])))
        try:
            sd.check_output_settings(device=self.device, channels=s.output_channels, dtype="float32",
                                     samplerate=rate)
        except sd.PortAudioError as exc:
            raise AudioDeviceError(
                f"output device {info['name']!r} refuses {s.output_channels} channel(s) at {rate} Hz "
                f"({exc}); set [audio] output_rate_hz / output_channels to what it supports") from exc
        self.device_rate = rate
        if rate != self.sample_rate:
            import soxr

            self._resampler = soxr.ResampleStream(self.sample_rate, rate, 1, dtype="float32",
                                                  quality=s.resample_quality)
        self._ring = FloatRing(max(1, rate * s.output_buffer_ms // 1000))
        block = max(1, rate * s.output_block_ms // 1000)
        self._block = np.zeros(block * 4, dtype=np.float32)
        self._finished.clear()
        self._stream = sd.OutputStream(
            device=self.device, samplerate=rate, channels=s.output_channels, dtype="float32",
            blocksize=block, latency=s.output_latency_ms / 1000.0, callback=self._callback,
            finished_callback=self._finished.set)
        self._stream.start()
        log.info("output stream on %r at %d Hz (engine %d Hz, %s), latency %.0f ms", info["name"], rate,
                 self.sample_rate, "resampled" if self._resampler else "native",
                 1000 * float(self._stream.latency))

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
        if self._stream is not None:
            try:
                self._stream.stop()
            finally:
                self._stream.close()
                self._stream = None

    # --- writer side ------------------------------------------------------
    def write(self, pcm: np.ndarray) -> None:
        if self._stream is None:
            self.start()
        assert self._ring is not None
        x = np.asarray(pcm, dtype=np.float32).reshape(-1)
        with self._write_lock:
            if self._resampler is not None:
                x = self._resampler.resample_chunk(x)
            accepted = self._ring.write(x)  # blocks for back-pressure; flush() interrupts it
            if accepted == len(x):  # after the copy: an empty ring before it is not an underrun,
                self._active = True  # nor one that flush() emptied

    def drain(self, timeout_s: float | None = None) -> bool:
        if self._ring is None:
            return True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._write_lock:
            if self._resampler is not None:  # the resampler's delayed tail
                self._ring.write(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True))
                self._resampler.clear()
            self._draining = True
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._ring.wait_empty(left):
                return False
            # the last block is still in the device's buffer
            tail = float(self._stream.latency) if self._stream is not None else 0.0
            if deadline is not None:
                tail = min(tail, max(0.0, deadline - time.monotonic()))
            time.sleep(tail)
            return True
        finally:
            self._draining = False
            self._active = False
            self._starved = False

    def flush(self) -> None:
        if self._ring is None:
            return
        self._ring.clear()  # first: wakes a writer blocked on a full ring
        with self._write_lock:
            self._ring.clear()
            if self._resampler is not None:
                self._resampler.clear()
            self._active = False
            self._starved = False

    def set_gain(self, gain: float) -> None:
        self._gain_target = float(min(max(gain, 0.0), 4.0))

    # --- state --------------------------------------------------------------
    @property
    def playing(self) -> bool:
        return self._ring is not None and (self._ring.available > 0 or self._draining)

    @property
    def underruns(self) -> int:
        """Times playback starved: the callback ran out of audio before drain()."""
        return self._underruns

    @property
    def xruns(self) -> int:
        """Output underflows that PortAudio reported (the callback itself was late)."""
        return self._xruns

    @property
    def alive(self) -> bool:
        return self._stream is not None and not self._finished.is_set()

    @property
    def queued_ms(self) -> float:
        return 0.0 if self._ring is None else 1000.0 * self._ring.available / max(1, self.device_rate)

    # --- the audio callback (PortAudio's thread): copy, scale, never wait ------
    def _callback(self, outdata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
        try:
            if status.output_underflow:
                self._xruns += 1
            if frames > len(self._block):
                self._block = np.zeros(frames, dtype=np.float32)
            buf = self._block[:frames]
            assert self._ring is not None
            n = self._ring.read_into(buf)
            if n < frames:
                buf[n:] = 0.0
                if self._active and not self._draining:
                    if not self._starved:
                        self._underruns += 1
                    self._starved = True
            else:
                self._starved = False
            target = self._gain_target
            if target != self._gain_now:  # a short ramp instead of a click
                buf *= np.linspace(self._gain_now, target, frames, dtype=np.float32)
                self._gain_now = target
            elif target != 1.0:
                buf *= target
            outdata[:] = buf[:, None]
        except Exception:  # an exception would abort the stream: play silence instead
            self._callback_errors += 1
            outdata.fill(0)
