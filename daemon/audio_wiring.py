"""Opens the audio devices through the audio side's factory module
(`daemon.audio.devices`, imported lazily): the speaker sink and the
microphone with its VAD worker, whose callbacks go to the daemon's
VoiceLink. With `--audio none`, or `default` on a machine without a sound
card, the daemon runs without them (output 'publish' only)."""

from __future__ import annotations

import importlib
import logging
from typing import Any

from daemon.audio.interfaces import AudioSink
from daemon.settings import Settings
from daemon.voice_link import VoiceLink
from models.errors import CosyEdgeError

log = logging.getLogger(__name__)


def _devices() -> Any | None:
    try:
        return importlib.import_module("daemon.audio.devices")
    except ImportError as exc:
        log.warning("audio devices unavailable (%s); running without speaker and microphone", exc)
        return None


def open_sink(settings: Settings) -> AudioSink | None:
    device = settings.audio_device
    if device == "none":
        return None
    devices = _devices()
    if devices is None:
        return None
    try:
        sink: AudioSink = devices.create_sink(settings.audio)
        return sink
    except Exception as exc:
        if device == "default":
            log.warning("no audio output device (%s); requests can only use output 'publish'", exc)
            return None
        raise CosyEdgeError(
            f"audio device {device!r} cannot be opened: {exc} (cosyedge doctor lists devices)"
        ) from exc


def start_voice_input(settings: Settings, voice: VoiceLink) -> Any | None:
    """The microphone and VAD worker, or None (no device, disabled, or the
    audio side does not provide them)."""
    if settings.audio_device == "none" or not settings.vad_enabled:
        return None
    devices = _devices()
    factory = getattr(devices, "create_vad_worker", None) if devices is not None else None
    if factory is None:
        log.warning("no VAD worker factory in daemon.audio.devices; microphone not started")
        return None
    try:
        source = devices.create_source(settings.audio)  # type: ignore[union-attr]
        worker = factory(
            settings.vad,
            source,
            on_event=voice.on_vad_event,
            on_utterance=voice.on_utterance,
            is_speaking=lambda: voice.speaking,
        )
        worker.start()
        return worker
    except Exception as exc:
        if settings.audio_device == "default":
            log.warning("no microphone (%s); VAD and barge-in are off", exc)
            return None
        raise CosyEdgeError(f"microphone {settings.audio_device!r} cannot be opened: {exc}") from exc
