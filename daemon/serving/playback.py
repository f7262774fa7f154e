"""The speaker side of the pipeline. Several synthesis workers may produce
audio at once, but the speaker plays one request at a time, in the order the
scheduler released them: `PlaybackOrder` keeps one lane (a bounded chunk
queue) per playing request in that order, and the playback worker plays only
the head lane. A later request's worker fills its lane up to the bound and
then waits, so memory stays within workers × bound chunks."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import soxr
from cosyedge_daemon.audio.interfaces import AudioSink
from cosyedge_daemon.serving.answer import Completer
from cosyedge_daemon.serving.jobs import Job

log = logging.getLogger(__name__)

TICK_S = 0.25  # worker loops wake at least this often (heartbeats, stop flag)
_WRITE_BLOCK_MS = 100  # playback writes in blocks this long: a stop lands within one block

Error = tuple[str, str]  # (code, message) of a failed request


@dataclass
class _Chunk:
    pcm: np.ndarray
    sample_rate: int


@dataclass(eq=False)
class Lane:
    """One playing request: its chunks not yet played, and whether its synthesis ended."""

    job: Job
    chunks: collections.deque[_Chunk] = field(default_factory=collections.deque)
    received: int = 0
    ended: bool = False
    error: Error | None = None  # the engine failed after some audio was queued


class PlaybackOrder:
    """Lanes of the requests that play, in scheduler order. Whoever removes a
    lane after its synthesis ended answers the request; a lane removed before
    that is answered by its synthesis worker (`end` returns True)."""

    def __init__(self) -> None:
        self._lanes: collections.deque[Lane] = collections.deque()
        self._cond = threading.Condition()
        self._playing: Lane | None = None  # the head lane once its first chunk went to the speaker
        self._closed = False

    # --- synthesis workers ------------------------------------------------------------
    def open(self, job: Job) -> None:
        """Reserve the job's turn; called in the order jobs leave the scheduler."""
        with self._cond:
            self._lanes.append(Lane(job))
            self._cond.notify_all()

    def put_chunk(self, job: Job, pcm: np.ndarray, sample_rate: int, limit: Callable[[], int],
                  beat: Callable[[], None]) -> bool:
        """Queue a chunk, waiting while the lane is full (`beat` keeps the
        waiting worker's heartbeat). False: not queued (stopped or closed)."""
        with self._cond:
            while True:
                lane = self._find(job)
                if lane is None or job.cancel.is_set() or self._closed:
                    return False
                if len(lane.chunks) < limit():
                    break
                beat()
                self._cond.wait(TICK_S)
            lane.chunks.append(_Chunk(pcm, sample_rate))
            lane.received += 1
            self._cond.notify_all()
            return True

    def end(self, job: Job, error: Error | None) -> bool:
        """The job's synthesis is over. True: the caller answers it now (none of
        its audio is left to play); False: the playback worker answers it after
        its audio played."""
        with self._cond:
            lane = self._find(job)
            if lane is None:
                return True
            gone = lane.received == 0 or self._closed or (job.cancel.is_set() and lane is not self._playing)
            if gone:
                self._remove(lane)
                return True
            lane.ended, lane.error = True, error
            self._cond.notify_all()
            return False

    # --- control --------------------------------------------------------------------------
    def take_stopped(self) -> list[Lane]:
        """Remove the stopped lanes whose synthesis ended and that are not on
        the speaker now; the caller answers them (a cancel waits for nobody)."""
        with self._cond:
            lanes = [x for x in self._lanes if x.ended and x.job.cancel.is_set() and x is not self._playing]
            for lane in lanes:
                self._remove(lane)
            return lanes

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # --- the playback worker ------------------------------------------------------------
    def next(self, timeout_s: float) -> tuple[Lane, _Chunk | None] | None:
        """(head lane, its next chunk), or (lane, None) when a lane is to be
        finished (all played, or stopped); None when there is nothing yet."""
        with self._cond:
            item = self._next_locked()
            if item is None:
                self._cond.wait(timeout_s)
                item = self._next_locked()
            return item

    def _next_locked(self) -> tuple[Lane, _Chunk | None] | None:
        for lane in list(self._lanes):
            if (lane.job.cancel.is_set() or self._closed) and lane is not self._playing:
                if lane.ended:
                    return lane, None
                self._remove(lane)  # its worker answers it when the engine stops
        if not self._lanes:
            return None
        head = self._lanes[0]
        if head.job.cancel.is_set() or self._closed:
            return (head, None) if head.ended else None
        if head.chunks:
            self._playing = head
            chunk = head.chunks.popleft()
            self._cond.notify_all()
            return head, chunk
        return (head, None) if head.ended else None

    def finish(self, lane: Lane) -> None:
        with self._cond:
            self._remove(lane)

    def _remove(self, lane: Lane) -> None:
        if lane in self._lanes:
            self._lanes.remove(lane)
        if self._playing is lane:
            self._playing = None
        lane.chunks.clear()
        self._cond.notify_all()

    def _find(self, job: Job) -> Lane | None:
        return next((x for x in self._lanes if x.job is job), None)

    def pending(self) -> bool:
        """Any lane left (playing, queued or still being synthesized)."""
        with self._cond:
            return bool(self._lanes)

    def chunks_waiting(self) -> bool:
        with self._cond:
            return any(x.chunks for x in self._lanes)

    def queued(self, job: Job) -> int:
        """Chunks of `job` synthesized but not yet on the speaker."""
        with self._cond:
            lane = self._find(job)
            return len(lane.chunks) if lane is not None else 0

    def waiting_jobs(self) -> int:
        """Requests behind the one on the speaker, waiting for their turn."""
        with self._cond:
            return max(0, len(self._lanes) - 1)


class PlaybackWorker:
    """Writes the head lane to the AudioSink (starting on its first chunk),
    drains it, then answers the request and moves on to the next lane."""

    def __init__(self, sink: AudioSink, order: PlaybackOrder, completer: Completer,
                 on_speaking: Callable[[bool], None] | None) -> None:
        self.sink = sink
        self.order = order
        self.completer = completer
        self.on_speaking = on_speaking
        self.playing_job: Job | None = None
        self.heartbeat = time.monotonic()
        self.speaking = False
        self._stop = threading.Event()
        self._resampler: tuple[Job, soxr.ResampleStream] | None = None

    def run(self, stop: threading.Event) -> None:
        self._stop = stop
        while True:
            self.heartbeat = time.monotonic()
            item = self.order.next(TICK_S)
            if item is None:
                if stop.is_set():
                    return  # lanes still in synthesis are answered by their workers (the order is closed)
                self._set_speaking(bool(self.sink.playing))
                continue
            lane, chunk = item
            job = lane.job
            if chunk is None:
                self._finish(lane)
                continue
            self.playing_job = job
            self._set_speaking(True)
            if job.playback_started_at is None:
                job.playback_started_at = time.monotonic()
            job.mark_audio_out()
            self._write(job, self._to_sink_rate(job, chunk))

    def _set_speaking(self, value: bool) -> None:
        if value != self.speaking:
            self.speaking = value
            if self.on_speaking is not None:
                try:
                    self.on_speaking(value)
                except Exception:
                    log.exception("speaking-state callback failed")

    def _write(self, job: Job, pcm: np.ndarray) -> None:
        """Write in short blocks so a stop takes effect within one block."""
        step = max(1, self.sink.sample_rate * _WRITE_BLOCK_MS // 1000)
        for start in range(0, pcm.size, step):
            if job.cancel.is_set() or self._stop.is_set():
                self.sink.flush()
                return
            self.sink.write(pcm[start : start + step])
        if job.cancel.is_set():
            self.sink.flush()

    def _finish(self, lane: Lane) -> None:
        job = lane.job
        if self._resampler is not None and self._resampler[0] is job and not job.cancel.is_set():
            self.sink.write(self._resampler[1].resample_chunk(np.zeros(0, dtype=np.float32), last=True))
        while self.playing_job is job and not job.cancel.is_set() and not self._stop.is_set():
            self.heartbeat = time.monotonic()
            if self.sink.drain(TICK_S):
                break
        was_playing = self.playing_job is job
        if was_playing:
            if job.cancel.is_set() or self._stop.is_set():
                self.sink.flush()
            self.playing_job = None
            self._resampler = None
        self.order.finish(lane)
        if was_playing and not self.order.chunks_waiting():  # silent before `done` goes out
            self._set_speaking(False)
        self.completer.complete(job, lane.error)

    def _to_sink_rate(self, job: Job, chunk: _Chunk) -> np.ndarray:
        if chunk.sample_rate == self.sink.sample_rate:
            return chunk.pcm
        if self._resampler is None or self._resampler[0] is not job:
            self._resampler = (job, soxr.ResampleStream(chunk.sample_rate, self.sink.sample_rate, 1,
                                                        dtype="float32"))
        return self._resampler[1].resample_chunk(chunk.pcm)
