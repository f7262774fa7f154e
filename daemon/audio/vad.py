"""VAD segmentation, pure logic: per-frame speech decisions (webrtcvad by
default) in, `speech_start` / `speech_end` events and utterances out.

- start: when `start_voiced_ms` of the last `start_window_ms` of frames are
  voiced, speech begins at the first voiced frame of that window (the onset),
  moved back over preceding frames that are clearly louder than the background
  (webrtcvad misses soft and plosive onsets depending on the frame grid);
- it is confirmed (speech_start is emitted) once the voiced part reaches
  `min_utterance_ms`; a burst that ends before that raises no event at all,
  so every speech_start has its speech_end and every utterance is long enough;
- end: after `hangover_ms` without a voiced frame, at the end of the last
  voiced frame (the hangover only delays the event, not the boundary), with
  webrtcvad's built-in hangover taken off and a quiet ending that is still
  clearly above the background put back;
- an utterance reaching `max_utterance_ms` is split (speech_end with
  `forced_split`); the next part starts at once if speech goes on;
- the utterance audio runs from `pre_roll_ms` before the onset to
  `post_roll_ms` after the end.

Times are the stream times passed with each frame (the start of the frame)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from cosyedge_daemon.audio.interfaces import VadEvent
from cosyedge_daemon.audio.pcm import iter_frames
from cosyedge_daemon.settings.audio import VAD_SAMPLE_RATE, VadSettings

Classifier = Callable[[bytes], bool]


# WebRTC VAD's own hangover (vad_core.c, kOverHangMax1*/kOverHangMax2*): after
# its last truly voiced frame it still answers "speech" for this many frames,
# per mode and frame length (10/20/30 ms): max1 after a run of at most 6
# voiced frames, max2 after a longer one. It answers 1 for both, so the
# segmenter takes them back off the end of each voiced run.
_OVERHANG_MAX1 = {0: (8, 4, 3), 1: (8, 4, 3), 2: (6, 3, 2), 3: (6, 3, 2)}
_OVERHANG_MAX2 = {0: (14, 7, 5), 1: (14, 7, 5), 2: (9, 5, 3), 3: (9, 5, 3)}
_MAX_SPEECH_FRAMES = 6
# One frame of it is kept: the frame where speech fades out is often judged
# noise already. Measured on recorded speech in silence and noise (README),
# this centres the end error (taking all of it off ends 30-60 ms early).
_OVERHANG_KEEP_FRAMES = 1


class WebRtcClassifier:
    """webrtcvad's per-frame decision, and the length of its built-in hangover."""

    def __init__(self, aggressiveness: int, frame_ms: int) -> None:
        import webrtcvad

        self._vad = webrtcvad.Vad(aggressiveness)
        k = frame_ms // 10 - 1
        self._oh1 = _OVERHANG_MAX1[aggressiveness][k]
        self._oh2 = _OVERHANG_MAX2[aggressiveness][k]

    def __call__(self, frame: bytes) -> bool:
        return bool(self._vad.is_speech(frame, VAD_SAMPLE_RATE))

    def trailing_overhang(self, run_frames: int) -> int:
        """How many frames at the end of a voiced run of `run_frames` (followed
        by an unvoiced frame) were the detector's hangover, not speech. A true
        run of T frames is observed as T + max1 (T <= 6) or T + max2 (T > 6)."""
        oh = self._oh1 if run_frames <= _MAX_SPEECH_FRAMES + self._oh1 else self._oh2
        return min(oh - _OVERHANG_KEEP_FRAMES, max(0, run_frames - 1))


@dataclass(frozen=True)
class Utterance:
    start_s: float  # the onset (speech_start time)
    end_s: float  # end of the last voiced frame (speech_end time)
    audio_start_s: float  # where `pcm` begins (onset minus pre-roll, within the stream)
    pcm: bytes  # 16 kHz mono PCM16, pre-roll and post-roll included
    forced_split: bool = False

    @property
    def duration_ms(self) -> float:
        return 1000.0 * (self.end_s - self.start_s)


SegmenterOutput = VadEvent | Utterance

# Onset refinement by energy (see Segmenter._begin).
_ONSET_LOOKBACK_MS = 150
_ONSET_MIN_DB = -60.0  # dBFS
_ONSET_BELOW_PEAK_DB = 25.0
_ONSET_ABOVE_FLOOR_DB = 10.0


def _frame_db(frame: bytes) -> float:
    x = np.frombuffer(frame, dtype=np.int16).astype(np.float32)
    return 10.0 * math.log10(float(np.dot(x, x)) / (len(x) * 32768.0 * 32768.0) + 1e-12)


class Segmenter:
    def __init__(
        self, settings: VadSettings, classify: Classifier | None = None,
        overhang: Callable[[int], int] | None = None,
    ) -> None:
        """`classify`: the per-frame decision (default: webrtcvad, whose built-in
        hangover `overhang` then takes off the end of each voiced run)."""
        self.settings = settings
        if classify is None:
            webrtc = WebRtcClassifier(settings.aggressiveness, settings.frame_ms)
            classify, overhang = webrtc, webrtc.trailing_overhang
        self._classify: Classifier = classify
        self._overhang = overhang
        self._run = 0  # observed consecutive voiced frames up to now
        self._frame_s = settings.frame_ms / 1000.0
        self._frame_bytes = settings.frame_samples * 2
        self._win = settings.frames(settings.start_window_ms)
        self._need = min(self._win, settings.frames(settings.start_voiced_ms))
        self._hang = settings.frames(settings.hangover_ms)
        self._pre = settings.frames(settings.pre_roll_ms)
        self._post_s = settings.frames(settings.post_roll_ms) * self._frame_s
        self._min_s = settings.min_utterance_ms / 1000.0
        self._max_s = settings.max_utterance_ms / 1000.0
        self._eps = self._frame_s / 4  # float tolerance when comparing frame times
        self._history: deque[tuple[float, bool, bytes]] = deque(maxlen=self._pre + self._win)
        self._state: Literal["idle", "candidate", "speech"] = "idle"
        self._frames: list[bytes] = []
        self._audio_start = 0.0
        self._onset = 0.0
        self._last_voiced_end = 0.0
        self._unvoiced_run = 0
        self._last_t = 0.0
        self._floor_db: float | None = None  # background level, tracked on non-speech frames
        self._lookback = settings.frames(_ONSET_LOOKBACK_MS)

    @property
    def in_speech(self) -> bool:
        """True between speech_start and speech_end."""
        return self._state == "speech"

    def process(self, frame: bytes, t: float) -> list[SegmenterOutput]:
        if len(frame) != self._frame_bytes:
            raise ValueError(f"VAD frame of {len(frame)} bytes; expected {self._frame_bytes} "
                             f"({self.settings.frame_ms} ms of 16 kHz PCM16)")
        return self.process_decision(frame, t, self._classify(frame))

    def process_decision(self, frame: bytes, t: float, voiced: bool) -> list[SegmenterOutput]:
        self._last_t = t
        out: list[SegmenterOutput] = []
        run_ended, self._run = (self._run if not voiced else 0), (self._run + 1 if voiced else 0)
        if self._state == "idle":
            if not voiced:
                self._track_floor(_frame_db(frame))
            self._history.append((t, voiced, frame))
            window = list(self._history)[-self._win:]
            if sum(v for _, v, _ in window) >= self._need:
                self._begin(window)
                out += self._maybe_confirm()
            return out
        self._frames.append(frame)
        if voiced:
            self._last_voiced_end = t + self._frame_s
            self._unvoiced_run = 0
        else:
            self._unvoiced_run += 1
            if run_ended and self._overhang is not None:  # the run's tail was the detector's hangover
                oh = self._overhang(run_ended)
                self._last_voiced_end = max(self._onset + self._frame_s,
                                            self._last_voiced_end - oh * self._frame_s)
                self._unvoiced_run += oh
        if self._state == "candidate":
            if self._unvoiced_run >= self._hang:  # too short: forget it without an event
                self._to_idle(keep_tail=True)
            else:
                out += self._maybe_confirm()
        elif self._unvoiced_run >= self._hang:
            out += self._end(self._last_voiced_end, forced=False)
        elif t + self._frame_s - self._onset >= self._max_s - self._eps:
            out += self._end(t + self._frame_s, forced=True)
        return out

    def flush(self) -> list[SegmenterOutput]:
        """End the stream (or pause it, for half-duplex): close an open
        utterance at its last voiced frame, drop an unconfirmed one, reset."""
        out = self._end(self._last_voiced_end, forced=False) if self._state == "speech" else []
        self._to_idle(keep_tail=False)
        return out

    # --- internals ------------------------------------------------------------
    def _track_floor(self, db: float) -> None:
        # follows the background down at once and up slowly (speech it missed barely moves it)
        if self._floor_db is None or db < self._floor_db:
            self._floor_db = db
        else:
            self._floor_db += 0.02 * (db - self._floor_db)

    def _begin(self, window: list[tuple[float, bool, bytes]]) -> None:
        history = list(self._history)
        first = len(history) - len(window) + next(i for i, (_, v, _) in enumerate(window) if v)
        # webrtcvad often misses the first frames of a soft or plosive onset (it depends on
        # where the frame grid falls): extend the onset back over frames that are clearly
        # louder than the background and not far below the speech that triggered
        db = [_frame_db(f) for _, _, f in history]
        loudest = max(db[first:])
        threshold = max(_ONSET_MIN_DB, loudest - _ONSET_BELOW_PEAK_DB,
                        (self._floor_db if self._floor_db is not None else -np.inf) + _ONSET_ABOVE_FLOOR_DB)
        limit = max(0, first - self._lookback)
        while first > limit and db[first - 1] > threshold:
            first -= 1
        self._onset = history[first][0]
        earliest = self._onset - self._pre * self._frame_s - self._eps
        kept = [(ft, f) for ft, _, f in history if ft >= earliest]
        self._audio_start = kept[0][0]
        self._frames = [f for _, f in kept]
        last = max(i for i, (_, v, _) in enumerate(window) if v)
        self._last_voiced_end = window[last][0] + self._frame_s
        self._unvoiced_run = len(window) - 1 - last
        self._state = "candidate"
        self._history.clear()

    def _maybe_confirm(self) -> list[SegmenterOutput]:
        if self._last_voiced_end - self._onset >= self._min_s - self._eps:
            self._state = "speech"
            return [VadEvent("speech_start", self._onset)]
        return []

    def _refine_end(self, end_s: float) -> float:
        """The mirror of the onset refinement: a quiet ending the detector
        dropped is kept while it stays clearly above the background."""
        k = round((end_s - self._audio_start) / self._frame_s)  # the first frame after the end
        o = round((self._onset - self._audio_start) / self._frame_s)
        if k <= o or k >= len(self._frames):
            return end_s
        db = [_frame_db(f) for f in self._frames[o:min(len(self._frames), k + self._lookback)]]
        loudest = max(db[:k - o])
        threshold = max(_ONSET_MIN_DB, loudest - _ONSET_BELOW_PEAK_DB,
                        (self._floor_db if self._floor_db is not None else -np.inf) + _ONSET_ABOVE_FLOOR_DB)
        i = k - o
        while i < len(db) and db[i] > threshold:
            i += 1
            end_s += self._frame_s
        return end_s

    def _end(self, end_s: float, forced: bool) -> list[SegmenterOutput]:
        if not forced:
            end_s = self._refine_end(end_s)
        audio_end = end_s if forced else min(end_s + self._post_s, self._last_t + self._frame_s)
        n = max(0, round((audio_end - self._audio_start) / self._frame_s))
        utt = Utterance(self._onset, end_s, self._audio_start, b"".join(self._frames[:n]), forced)
        out: list[SegmenterOutput] = [
            VadEvent("speech_end", end_s, utterance_ms=utt.duration_ms, forced_split=forced), utt]
        if forced:  # speech goes on: a new candidate from the split point, no pre-roll
            self._onset = self._audio_start = self._last_voiced_end = end_s
            self._frames = []
            self._unvoiced_run = 0
            self._state = "candidate"
        else:
            self._to_idle(keep_tail=True)
        return out

    def _to_idle(self, keep_tail: bool) -> None:
        self._history.clear()
        if keep_tail and self._frames:  # the trailing silence serves as the next pre-roll
            tail = self._frames[-(self._pre + self._win):] if self._pre + self._win else []
            t_end = self._last_t + self._frame_s
            for i, f in enumerate(tail):
                self._history.append((t_end - (len(tail) - i) * self._frame_s, False, f))
        self._frames = []
        self._state = "idle"


def segment_pcm(pcm16: np.ndarray, settings: VadSettings,
                classify: Classifier | None = None) -> list[Utterance]:
    """Segment a whole 16 kHz mono recording (what `cosyedge vad` prints)."""
    seg = Segmenter(settings, classify)
    utterances: list[Utterance] = []
    for frame, t in iter_frames(np.asarray(pcm16, dtype=np.int16), settings.frame_samples):
        utterances += [o for o in seg.process(frame, t) if isinstance(o, Utterance)]
    utterances += [o for o in seg.flush() if isinstance(o, Utterance)]
    return utterances
