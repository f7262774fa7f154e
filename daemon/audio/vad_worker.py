"""The VAD worker: takes frames from an AudioSource into a bounded queue
(`on_frame` never blocks: a full queue drops and counts), runs the segmenter
on its own thread and calls `on_event(VadEvent)` and
`on_segment(wav_bytes, start_s, end_s)`; the daemon publishes them (MQTT,
Hermes) and applies barge-in.

Half-duplex: while the daemon reports that it is speaking (`set_speaking`)
and for `half_duplex_tail_ms` after, frames are not classified at all (an
utterance in progress is closed first), so the daemon's own voice from the
speaker cannot start an utterance. Without half-duplex every frame is
classified and speech while speaking is a barge-in."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from cosyedge_daemon.audio.interfaces import AudioSource, VadEvent
from cosyedge_daemon.audio.vad import Classifier, Segmenter, SegmenterOutput, Utterance
from cosyedge_daemon.settings.audio import VAD_SAMPLE_RATE, VadSettings
from cosyedge_models.pcm import wav_bytes

log = logging.getLogger(__name__)

EventCallback = Callable[[VadEvent], None]
SegmentCallback = Callable[[bytes, float, float], None]  # (WAV bytes, start_s, end_s)


class FrameTap(Protocol):
    """Another consumer of the classified stream (the Wyoming satellite), on
    the worker's thread: each VAD event, then each frame that was classified
    (never the frames muted by half-duplex). Must not block."""

    def on_vad_event(self, event: VadEvent) -> None: ...

    def on_frame(self, frame: bytes, t: float) -> None: ...


class VadWorker:
    def __init__(self, source: AudioSource, settings: VadSettings, on_event: EventCallback,
                 on_segment: SegmentCallback | None = None, queue_frames: int = 200,
                 classify: Classifier | None = None) -> None:
        if source.frame_ms != settings.frame_ms:
            raise ValueError(
                f"source frames are {source.frame_ms} ms, the VAD expects {settings.frame_ms} ms")
        self.source = source
        self.settings = settings
        self._on_event = on_event
        self._on_segment = on_segment
        self._segmenter = Segmenter(settings, classify)
        self._queue: queue.Queue[tuple[bytes, float, bool] | None] = queue.Queue(maxsize=queue_frames)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._speaking = False
        self._mute_until = 0.0  # monotonic end of the half-duplex tail
        self._running = False
        self.frames_in = 0
        self.frames_dropped = 0
        self.frames_ignored = 0
        self.events = 0
        self.segments = 0
        self.callback_errors = 0
        self.taps: list[FrameTap] = []

    # --- control ----------------------------------------------------------------
    def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="vad", daemon=True)
        self._thread.start()
        self.source.start(self._on_frame)

    def stop(self) -> None:
        """Stop capturing, process what is queued, close an open utterance."""
        if not self._running:
            return
        self.source.stop()
        self._stopping.set()
        # wakes the worker at once; with a full queue it ends when the queue is empty
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._running = False

    def set_speaking(self, speaking: bool) -> None:
        """The daemon tells when its playback starts and ends (any thread)."""
        if self._speaking and not speaking:
            self._mute_until = time.monotonic() + self.settings.half_duplex_tail_ms / 1000.0
        self._speaking = speaking

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def in_speech(self) -> bool:
        return self._segmenter.in_speech

    def _muted(self) -> bool:
        return self.settings.half_duplex and (self._speaking or time.monotonic() < self._mute_until)

    # --- the source's thread: queue only -----------------------------------------
    def _on_frame(self, frame: bytes, t: float) -> None:
        self.frames_in += 1
        try:
            self._queue.put_nowait((frame, t, self._muted()))
        except queue.Full:
            self.frames_dropped += 1

    # --- the worker thread ------------------------------------------------------
    def _run(self) -> None:
        was_muted = False
        while True:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if not self._stopping.is_set():
                    continue
                item = None
            if item is None:
                self._emit(self._segmenter.flush())
                return
            frame, t, muted = item
            if muted:
                if not was_muted:  # close what was being said before we started speaking
                    self._emit(self._segmenter.flush())
                was_muted = True
                self.frames_ignored += 1
                continue
            was_muted = False
            try:
                outputs = self._segmenter.process(frame, t)
            except Exception:
                log.exception("VAD failed on a frame; skipping it")
                continue
            self._emit(outputs)
            for tap in self.taps:
                try:
                    tap.on_frame(frame, t)
                except Exception:
                    self.callback_errors += 1
                    log.exception("VAD frame tap failed")

    def _emit(self, outputs: list[SegmenterOutput]) -> None:
        for out in outputs:
            try:
                if isinstance(out, Utterance):
                    if self._on_segment is not None:
                        self.segments += 1
                        self._on_segment(wav_bytes(out.pcm, VAD_SAMPLE_RATE), out.start_s, out.end_s)
                else:
                    self.events += 1
                    self._on_event(out)
                    for tap in self.taps:
                        tap.on_vad_event(out)
            except Exception:  # a failing publisher must not stop the microphone
                self.callback_errors += 1
                log.exception("VAD callback failed")
