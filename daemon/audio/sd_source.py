"""The microphone: a sounddevice (PortAudio) raw input stream at 16 kHz mono
PCM16 (or the device's own rate, resampled with soxr)."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import numpy as np
from cosyedge_daemon.audio.errors import AudioDeviceError
from cosyedge_daemon.audio.interfaces import FrameCallback
from cosyedge_daemon.audio.pcm import Framer
from cosyedge_daemon.audio.sources import check_frame_ms
from cosyedge_daemon.settings.audio import VAD_SAMPLE_RATE, AudioSettings

log = logging.getLogger(__name__)


class SoundDeviceSource:
    """The microphone. The PortAudio callback only copies each block into a
    bounded queue (when it is full the block is dropped and counted); a
    thread resamples to 16 kHz when the device runs at another rate, cuts
    fixed frames and calls `on_frame`."""

    sample_rate = VAD_SAMPLE_RATE

    def __init__(self, settings: AudioSettings, frame_ms: int = 30, device: int | None = None) -> None:
        check_frame_ms(frame_ms)
        self.settings = settings
        self.frame_ms = frame_ms
        self.device = device
        self.device_rate = 0
        self._stream: Any = None
        self._queue: queue.Queue[tuple[bytes, int] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._dropped_blocks = 0
        self._dropped_since_put = 0  # device samples lost before the next queued block
        self._xruns = 0
        self.frames_sent = 0

    def _pick_rate(self) -> int:
        import sounddevice as sd

        if self.settings.input_rate_hz:
            try:
                sd.check_input_settings(device=self.device, channels=1, dtype="int16",
                                        samplerate=self.settings.input_rate_hz)
            except sd.PortAudioError as exc:
                raise AudioDeviceError(
                    f"input device refuses mono PCM16 at {self.settings.input_rate_hz} Hz ({exc}); "
                    "leave [audio] input_rate_hz unset to use its own rate") from exc
            return self.settings.input_rate_hz
        try:
            sd.check_input_settings(device=self.device, channels=1, dtype="int16", samplerate=VAD_SAMPLE_RATE)
            return VAD_SAMPLE_RATE
        except Exception:  # e.g. a USB microphone that only runs at 44.1/48 kHz
            info = sd.query_devices(self.device, "input")
            return int(round(float(info["default_samplerate"])))

    def start(self, on_frame: FrameCallback) -> None:
        import sounddevice as sd

        rate = self._pick_rate()
        self.device_rate = rate
        block = rate * self.frame_ms // 1000
        blocks = max(2, self.settings.input_queue_ms // self.frame_ms)
        self._queue = queue.Queue(maxsize=blocks)
        self._stream = sd.RawInputStream(device=self.device, samplerate=rate, channels=1, dtype="int16",
                                         blocksize=block, callback=self._callback)
        self._thread = threading.Thread(target=self._run, args=(on_frame, rate), name="mic", daemon=True)
        self._thread.start()
        self._stream.start()
        log.info("input stream on %r at %d Hz%s", sd.query_devices(self.device, "input")["name"], rate,
                 "" if rate == VAD_SAMPLE_RATE else " (resampled to 16 kHz)")

    def _callback(self, indata: Any, frames: int, time_info: Any, status: Any) -> None:
        if status.input_overflow:
            self._xruns += 1
        try:
            self._queue.put_nowait((bytes(indata), self._dropped_since_put))
            self._dropped_since_put = 0
        except queue.Full:
            self._dropped_blocks += 1
            self._dropped_since_put += frames

    def _run(self, on_frame: FrameCallback, rate: int) -> None:
        resampler = None
        if rate != VAD_SAMPLE_RATE:
            import soxr

            resampler = soxr.ResampleStream(rate, VAD_SAMPLE_RATE, 1, dtype="int16",
                                            quality=self.settings.resample_quality)
        framer = Framer(VAD_SAMPLE_RATE * self.frame_ms // 1000)
        frame_s = self.frame_ms / 1000.0
        clock = 0.0  # stream time of the next frame
        while True:
            item = self._queue.get()
            if item is None:
                return
            data, dropped = item
            if dropped:  # lost audio still takes time: keep the clock true, restart the framing
                clock += dropped / rate
                framer.reset()
            if resampler is not None:
                data = np.asarray(resampler.resample_chunk(np.frombuffer(data, dtype=np.int16))).tobytes()
            for frame in framer.push(data):
                try:
                    on_frame(frame, clock)
                except Exception:
                    log.exception("on_frame failed; capture goes on")
                clock += frame_s
                self.frames_sent += 1

    def stop(self) -> None:
        if self._stream is not None:
            try:
                self._stream.stop()
            finally:
                self._stream.close()
                self._stream = None
        if self._thread is not None:
            try:  # the callback has stopped: there is room, or the consumer is taking frames
                self._queue.put(None, timeout=5)
            except queue.Full:
                log.warning("capture thread is not taking frames; leaving it behind")
            self._thread.join(timeout=5)
            self._thread = None

    @property
    def alive(self) -> bool:
        """The stream is running (False after stop() or when PortAudio ended it, e.g. a USB mic unplugged)."""
        return self._stream is not None and bool(self._stream.active)

    @property
    def dropped_blocks(self) -> int:
        """Blocks dropped because our queue was full (the consumer fell behind)."""
        return self._dropped_blocks

    @property
    def xruns(self) -> int:
        """Input overflows that PortAudio reported (its thread was not scheduled in time)."""
        return self._xruns

    @property
    def overflows(self) -> int:
        """Blocks lost: dropped because the queue was full, plus PortAudio input overflows."""
        return self._dropped_blocks + self._xruns
