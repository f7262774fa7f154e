"""The one place where audio devices are created (tests replace these
functions). Device specs: "none", "default", an index, a substring of a
device name, or "wav:PATH"."""

from __future__ import annotations

import logging
from typing import Any

from cosyedge_daemon.audio.errors import AudioDeviceError
from cosyedge_daemon.audio.interfaces import AudioSink, AudioSource
from cosyedge_daemon.audio.sinks import NullSink, WavFileSink
from cosyedge_daemon.audio.sources import wav_file_source
from cosyedge_daemon.settings.audio import AudioSettings, VadSettings

__all__ = ["AudioDeviceError", "create_sink", "create_source", "list_devices", "resolve_device"]

log = logging.getLogger(__name__)


def _sounddevice() -> Any:
    try:
        import sounddevice as sd
    except OSError as exc:  # the Python package is there, the PortAudio library is not
        raise AudioDeviceError(
            f"PortAudio is not available ({exc}); install it with: apt-get install libportaudio2") from exc
    return sd


def list_devices(kind: str | None = None) -> list[dict[str, Any]]:
    """Devices as PortAudio sees them: index, name, host API, channels, default rate."""
    sd = _sounddevice()
    apis = sd.query_hostapis()
    out = []
    for dev in sd.query_devices():
        if kind == "input" and dev["max_input_channels"] < 1:
            continue
        if kind == "output" and dev["max_output_channels"] < 1:
            continue
        out.append({"index": dev["index"], "name": dev["name"], "hostapi": apis[dev["hostapi"]]["name"],
                    "inputs": dev["max_input_channels"], "outputs": dev["max_output_channels"],
                    "default_samplerate": dev["default_samplerate"]})
    return out


def resolve_device(spec: str | int, kind: str) -> int | None:
    """A PortAudio device index for `spec` (None: the host's default device)."""
    sd = _sounddevice()
    key = "max_output_channels" if kind == "output" else "max_input_channels"
    devices = [d for d in sd.query_devices() if d[key] > 0]
    if not devices:
        raise AudioDeviceError(
            f"no {kind} audio device found (PortAudio lists none); use {kind}_device = \"none\" or "
            "\"wav:PATH\", or check the sound card / JACK server (`cosyedge doctor`)")
    if spec == "default":
        try:
            sd.query_devices(None, kind)
        except Exception as exc:
            raise AudioDeviceError(f"there is no default {kind} device ({exc}); name one of: "
                                   + ", ".join(f"{d['index']}: {d['name']}" for d in devices)) from exc
        return None
    if isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit()):
        index = int(spec)
        if any(d["index"] == index for d in devices):
            return index
    else:
        matches = [d for d in devices if spec.lower() in d["name"].lower()]
        exact = [d for d in matches if d["name"].lower() == spec.lower()]
        if len(exact) == 1 or len(matches) == 1:
            return int((exact or matches)[0]["index"])
        if len(matches) > 1:
            raise AudioDeviceError(f"{kind} device {spec!r} is ambiguous: it matches "
                                   + ", ".join(f"{d['index']}: {d['name']}" for d in matches))
    raise AudioDeviceError(f"no {kind} device {spec!r}; available: "
                           + ", ".join(f"{d['index']}: {d['name']}" for d in devices))


def create_sink(settings: AudioSettings, sample_rate: int) -> AudioSink:
    """The speaker for audio at `sample_rate` (the engine's rate), not yet started."""
    spec = settings.output_device
    if spec == "none":
        return NullSink(sample_rate)
    if isinstance(spec, str) and spec.startswith("wav:"):
        return WavFileSink(spec[4:], sample_rate, channels=settings.output_channels)
    from cosyedge_daemon.audio.sd_sink import SoundDeviceSink

    return SoundDeviceSink(sample_rate, settings, device=resolve_device(spec, "output"))


def create_source(settings: AudioSettings, vad: VadSettings | None = None) -> AudioSource | None:
    """The microphone delivering `vad.frame_ms` frames, or None when capture is off."""
    frame_ms = (vad or VadSettings()).frame_ms
    spec = settings.input_device
    if not settings.capture or spec == "none":
        return None
    if isinstance(spec, str) and spec.startswith("wav:"):
        return wav_file_source(spec[4:], frame_ms, realtime=True)
    from cosyedge_daemon.audio.sd_source import SoundDeviceSource

    return SoundDeviceSource(settings, frame_ms, device=resolve_device(spec, "input"))
