"""Typed, validated settings for audio I/O and the VAD. Built once (from the
`[audio]` and `[vad]` tables of the daemon's TOML config via `from_mapping`,
or with `dataclasses.replace` for CLI overrides); every error names the field
and the allowed values."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from models.errors import CosyEdgeError


class AudioSettingsError(CosyEdgeError, ValueError):
    """An audio or VAD setting is out of range or of the wrong type."""


BargeIn = Literal["off", "stop", "duck"]
BARGE_IN_CHOICES: tuple[str, ...] = ("off", "stop", "duck")
FRAME_MS_CHOICES: tuple[int, ...] = (10, 20, 30)
RESAMPLE_QUALITIES: tuple[str, ...] = ("QQ", "LQ", "MQ", "HQ", "VHQ")
VAD_SAMPLE_RATE = 16000  # webrtcvad and the capture path work at 16 kHz mono PCM16


def _check(cond: bool, section: str, name: str, allowed: str, value: object) -> None:
    if not cond:
        raise AudioSettingsError(f"[{section}] {name} = {value!r} is invalid: allowed {allowed}")


def _check_device(section: str, name: str, value: object) -> None:
    ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
        isinstance(value, str) and value.strip() != "" and (not value.startswith("wav:") or len(value) > 4))
    _check(ok, section, name,
           '"none", "default", a device name (substring), a device index >= 0, or "wav:PATH"', value)


@dataclass(frozen=True)
class AudioSettings:
    """Speaker and microphone. Devices: "none" (no device: a null sink / no
    capture), "default", a device index, a (sub)string of a device name as
    `cosyedge doctor` lists them, or "wav:PATH" (write the output to / read
    the input from a WAV file; for tests and machines without a sound card)."""

    output_device: str | int = "default"
    output_rate_hz: int | None = None  # None: the device's default rate; soxr resamples the engine rate to it
    output_channels: int = 1  # mono is copied to every channel
    output_buffer_ms: int = 500  # playback queue; `write` blocks while it is full (back-pressure)
    output_block_ms: int = 20  # audio callback period
    output_latency_ms: int = 60  # PortAudio's suggested device latency
    input_device: str | int = "default"
    capture: bool = True  # microphone + VAD on/off
    input_rate_hz: int | None = None  # None: 16 kHz if the device takes it, else its default rate (resampled)
    input_queue_ms: int = 2000  # capture queue; when full, frames are dropped and counted
    resample_quality: str = "HQ"

    def __post_init__(self) -> None:
        s = "audio"
        _check_device(s, "output_device", self.output_device)
        _check_device(s, "input_device", self.input_device)
        for name in ("output_rate_hz", "input_rate_hz"):
            v = getattr(self, name)
            _check(v is None or 8000 <= v <= 192000, s, name, "8000..192000 or unset (device default)", v)
        _check(1 <= self.output_channels <= 8, s, "output_channels", "1..8", self.output_channels)
        _check(50 <= self.output_buffer_ms <= 10000, s, "output_buffer_ms", "50..10000",
               self.output_buffer_ms)
        _check(5 <= self.output_block_ms <= 200, s, "output_block_ms", "5..200", self.output_block_ms)
        _check(1 <= self.output_latency_ms <= 1000, s, "output_latency_ms", "1..1000", self.output_latency_ms)
        _check(100 <= self.input_queue_ms <= 60000, s, "input_queue_ms", "100..60000", self.input_queue_ms)
        _check(self.resample_quality in RESAMPLE_QUALITIES, s, "resample_quality",
               ", ".join(RESAMPLE_QUALITIES), self.resample_quality)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> AudioSettings:
        return _from_mapping(cls, data, "audio")


@dataclass(frozen=True)
class VadSettings:
    """WebRTC VAD segmentation (see README "Audio and VAD"). Times are stream
    times of the 16 kHz capture; every `*_ms` value is rounded to whole frames."""

    aggressiveness: int = 3  # webrtcvad mode: 0 (least) .. 3 (most aggressive at rejecting non-speech)
    frame_ms: int = 30
    start_window_ms: int = 150  # start hysteresis: look at the last start_window_ms of frames ...
    start_voiced_ms: int = 90  # ... and start when at least this much of them is voiced
    hangover_ms: int = 600  # end after this long without voice (bridges pauses between words)
    pre_roll_ms: int = 300  # audio kept before the detected start in the utterance WAV
    post_roll_ms: int = 150  # audio kept after the detected end in the utterance WAV (<= hangover_ms)
    min_utterance_ms: int = 210  # shorter bursts (clicks, coughs) raise no event at all
    max_utterance_ms: int = 15000  # longer speech is split: speech_end (forced) + a new speech_start
    half_duplex: bool = False  # ignore the microphone while the daemon speaks (no echo canceller)
    half_duplex_tail_ms: int = 300  # ... and this long after it stops (device latency, room echo)
    barge_in: str = "stop"  # speech while speaking: "off", "stop" the playback, or "duck" it
    duck_gain: float = 0.25  # playback gain while ducked (0..1)

    def __post_init__(self) -> None:
        s = "vad"
        _check(self.aggressiveness in (0, 1, 2, 3), s, "aggressiveness", "0, 1, 2, 3", self.aggressiveness)
        _check(self.frame_ms in FRAME_MS_CHOICES, s, "frame_ms", "10, 20, 30", self.frame_ms)
        _check(self.frame_ms <= self.start_window_ms <= 3000, s, "start_window_ms",
               f"{self.frame_ms}..3000 (at least one frame)", self.start_window_ms)
        _check(self.frame_ms <= self.start_voiced_ms <= self.start_window_ms, s, "start_voiced_ms",
               f"{self.frame_ms}..start_window_ms ({self.start_window_ms})", self.start_voiced_ms)
        _check(self.frame_ms <= self.hangover_ms <= 10000, s, "hangover_ms", f"{self.frame_ms}..10000",
               self.hangover_ms)
        _check(0 <= self.pre_roll_ms <= 5000, s, "pre_roll_ms", "0..5000", self.pre_roll_ms)
        _check(0 <= self.post_roll_ms <= self.hangover_ms, s, "post_roll_ms",
               f"0..hangover_ms ({self.hangover_ms})", self.post_roll_ms)
        _check(0 <= self.min_utterance_ms <= 10000, s, "min_utterance_ms", "0..10000", self.min_utterance_ms)
        _check(max(1000, self.min_utterance_ms + self.frame_ms) <= self.max_utterance_ms <= 600000, s,
               "max_utterance_ms", "1000..600000 and above min_utterance_ms", self.max_utterance_ms)
        _check(0 <= self.half_duplex_tail_ms <= 5000, s, "half_duplex_tail_ms", "0..5000",
               self.half_duplex_tail_ms)
        _check(self.barge_in in BARGE_IN_CHOICES, s, "barge_in", '"off", "stop", "duck"', self.barge_in)
        _check(0.0 <= self.duck_gain <= 1.0, s, "duck_gain", "0.0..1.0", self.duck_gain)
        if self.half_duplex and self.barge_in != "off":
            raise AudioSettingsError(
                f'[vad] half_duplex = true with barge_in = "{self.barge_in}" is invalid: half-duplex '
                'ignores the microphone while the daemon speaks, so nothing could barge in; '
                'set barge_in = "off" or half_duplex = false')

    def frames(self, ms: int) -> int:
        """A duration in whole frames (at least one for a non-zero duration)."""
        return 0 if ms <= 0 else max(1, round(ms / self.frame_ms))

    @property
    def frame_samples(self) -> int:
        return VAD_SAMPLE_RATE * self.frame_ms // 1000

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> VadSettings:
        return _from_mapping(cls, data, "vad")


_T = typing.TypeVar("_T")


def _type_ok(value: object, annotation: object) -> bool:
    """Check a TOML value against a field annotation (int, float, bool, str and
    their `| None` unions); bool is never accepted for a number."""
    options = typing.get_args(annotation) or (annotation,)
    for opt in options:
        if opt is type(None) and value is None:
            return True
        if opt is bool and isinstance(value, bool):
            return True
        if opt is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if opt is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if opt is str and isinstance(value, str):
            return True
    return False


def _type_name(annotation: object) -> str:
    options = typing.get_args(annotation) or (annotation,)
    return " or ".join("unset" if o is type(None) else getattr(o, "__name__", str(o)) for o in options)


def _from_mapping(cls: type[_T], data: Mapping[str, Any], section: str) -> _T:
    if not isinstance(data, Mapping):
        raise AudioSettingsError(f"[{section}] must be a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise AudioSettingsError(
            f"[{section}] unknown key(s) {', '.join(unknown)}: allowed keys are {', '.join(names)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if not _type_ok(value, hints[name]):
            raise AudioSettingsError(
                f"[{section}] {name} = {value!r} has the wrong type: expected {_type_name(hints[name])}")
        kwargs[name] = float(value) if hints[name] is float else value
    return cls(**kwargs)
