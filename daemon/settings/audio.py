"""Typed, validated settings for audio I/O and the VAD: the `[audio]` and
`[vad]` tables of the daemon's TOML config, in the one settings schema
(models/settings_schema.py). Built once (`from_mapping`, or
`dataclasses.replace`, which validates too); every error names the field
and the allowed values."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cosyedge_models.settings_schema import ConfigError, build_section, check_fields, setting

AudioSettingsError = ConfigError  # an audio or VAD setting is out of range or of the wrong type


BargeIn = Literal["off", "stop", "duck"]
BARGE_IN_CHOICES: tuple[str, ...] = ("off", "stop", "duck")
FRAME_MS_CHOICES: tuple[int, ...] = (10, 20, 30)
RESAMPLE_QUALITIES: tuple[str, ...] = ("QQ", "LQ", "MQ", "HQ", "VHQ")
VAD_SAMPLE_RATE = 16000  # webrtcvad and the capture path work at 16 kHz mono PCM16

_DEVICE_WORDS = '"none", "default", a device name (substring), a device index >= 0, or "wav:PATH"'


def _device_ok(value: str | int) -> bool:
    if isinstance(value, int):
        return value >= 0
    return value.strip() != "" and (not value.startswith("wav:") or len(value) > 4)


def _device(default: str, doc: str) -> Any:
    return setting(default, doc, check=_device_ok, allowed=_DEVICE_WORDS)


def _need(cond: bool, section: str, name: str, allowed: str, value: object) -> None:
    """A rule between fields (the schema checks each field alone)."""
    if not cond:
        raise AudioSettingsError(f"[{section}] {name} = {value!r}: allowed values: {allowed}")


@dataclass(frozen=True)
class AudioSettings:
    """Speaker and microphone. Devices: "none" (no device: a null sink / no
    capture), "default", a device index, a (sub)string of a device name as
    `cosyedge doctor` lists them, or "wav:PATH" (write the output to / read
    the input from a WAV file; for tests and machines without a sound card)."""

    output_device: str | int = _device("default", "speaker (default: [audio] device)")
    output_rate_hz: int | None = setting(
        None, "speaker rate; unset: the device's default rate (soxr resamples the engine rate to it)",
        min=8000, max=192000)
    output_channels: int = setting(1, "speaker channels; mono is copied to every channel", min=1, max=8)
    output_buffer_ms: int = setting(
        500, "playback queue; writing blocks while it is full (back-pressure)", min=50, max=10000)
    output_block_ms: int = setting(20, "audio callback period", min=5, max=200)
    output_latency_ms: int = setting(60, "PortAudio's suggested device latency", min=1, max=1000)
    input_device: str | int = _device("default", "microphone (default: [audio] device)")
    capture: bool = setting(True, "microphone and VAD on or off")
    input_rate_hz: int | None = setting(
        None, "microphone rate; unset: 16 kHz if the device takes it, else its default rate (resampled)",
        min=8000, max=192000)
    input_queue_ms: int = setting(
        2000, "capture queue; when full, frames are dropped and counted", min=100, max=60000)
    resample_quality: str = setting("HQ", "soxr resampling quality", choices=RESAMPLE_QUALITIES)

    def __post_init__(self) -> None:
        check_fields(self, "audio")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> AudioSettings:
        return build_section(cls, data, "audio")


@dataclass(frozen=True)
class VadSettings:
    """WebRTC VAD segmentation (see docs "Audio and VAD"). Times are stream
    times of the 16 kHz capture; every `*_ms` value is rounded to whole frames."""

    enabled: bool = setting(True, "voice activity detection on the microphone on or off")
    aggressiveness: int = setting(
        3, "webrtcvad mode: 0 (least) .. 3 (most aggressive at rejecting non-speech)", choices=(0, 1, 2, 3))
    frame_ms: int = setting(30, "VAD frame length", choices=FRAME_MS_CHOICES)
    start_window_ms: int = setting(
        150, "start hysteresis: look at the last start_window_ms of frames ...", min=10, max=3000)
    start_voiced_ms: int = setting(
        90, "... and start when at least this much of them is voiced (<= start_window_ms)", min=10, max=3000)
    hangover_ms: int = setting(
        600, "end after this long without voice (bridges pauses between words)", min=10, max=10000)
    pre_roll_ms: int = setting(300, "audio kept before the detected start in the utterance WAV", min=0, max=5000)
    post_roll_ms: int = setting(
        150, "audio kept after the detected end in the utterance WAV (<= hangover_ms)", min=0, max=10000)
    min_utterance_ms: int = setting(
        210, "shorter bursts (clicks, coughs) raise no event at all", min=0, max=10000)
    max_utterance_ms: int = setting(
        15000, "longer speech is split: speech_end (forced) + a new speech_start (above min_utterance_ms)",
        min=1000, max=600000)
    half_duplex: bool = setting(False, "ignore the microphone while the daemon speaks (no echo canceller)")
    half_duplex_tail_ms: int = setting(
        300, "... and this long after it stops (device latency, room echo)", min=0, max=5000)
    barge_in: str = setting(
        "stop", "speech while speaking: off, stop the playback, or duck it", choices=BARGE_IN_CHOICES)
    duck_gain: float = setting(0.25, "playback gain while ducked", min=0.0, max=1.0)

    def __post_init__(self) -> None:
        s = "vad"
        check_fields(self, s)
        _need(self.frame_ms <= self.start_window_ms, s, "start_window_ms",
              f"{self.frame_ms}..3000 (at least one frame)", self.start_window_ms)
        _need(self.frame_ms <= self.start_voiced_ms <= self.start_window_ms, s, "start_voiced_ms",
              f"{self.frame_ms}..start_window_ms ({self.start_window_ms})", self.start_voiced_ms)
        _need(self.frame_ms <= self.hangover_ms, s, "hangover_ms", f"{self.frame_ms}..10000", self.hangover_ms)
        _need(self.post_roll_ms <= self.hangover_ms, s, "post_roll_ms",
              f"0..hangover_ms ({self.hangover_ms})", self.post_roll_ms)
        _need(self.min_utterance_ms + self.frame_ms <= self.max_utterance_ms, s,
              "max_utterance_ms", "1000..600000 and above min_utterance_ms", self.max_utterance_ms)
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
        return build_section(cls, data, "vad")
