"""Opens the audio devices through the audio side's factory module
(`cosyedge_daemon.audio.devices`, imported lazily): the speaker sink and the
microphone with its VAD worker, whose callbacks go to the daemon's
VoiceLink. With `--audio none`, or `default` on a machine without a sound
card, the daemon runs without them (output 'publish' only)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cosyedge_daemon.api.vad_topics import VoiceLink
from cosyedge_daemon.audio.interfaces import AudioSink
from cosyedge_daemon.settings.schema import Settings
from cosyedge_models.errors import CosyEdgeError

if TYPE_CHECKING:
    from cosyedge_daemon.audio.vad_worker import VadWorker

log = logging.getLogger(__name__)


# The rate the sink is opened at: CosyVoice 2's. The pipeline resamples
# (soxr) chunks of engines with another rate, e.g. the espeak-ng fallback.
SINK_RATE_HZ = 24000


def open_sink(settings: Settings) -> AudioSink | None:
    device = settings.audio_device
    if device == "none":
        return None
    from cosyedge_daemon.audio.devices import create_sink

    try:
        sink = create_sink(settings.audio_settings, SINK_RATE_HZ)
        sink.start()
        return sink
    except Exception as exc:
        if device == "default":
            log.warning("no audio output device (%s); requests can only use output 'publish'", exc)
            return None
        raise CosyEdgeError(
            f"audio device {device!r} cannot be opened: {exc} (cosyedge doctor lists devices)"
        ) from exc


def start_voice_input(settings: Settings, voice: VoiceLink) -> VadWorker | None:
    """The microphone and its VAD worker, or None (no device or disabled)."""
    if settings.audio_device == "none" or not settings.vad_enabled:
        return None
    from cosyedge_daemon.audio.devices import create_source
    from cosyedge_daemon.audio.vad_worker import VadWorker

    try:
        source = create_source(settings.audio_settings, settings.vad_settings)
        if source is None:
            return None
        worker = VadWorker(source, settings.vad_settings, on_event=voice.on_vad_event,
                           on_segment=lambda wav, _start_s, _end_s: voice.on_utterance(wav))
        worker.start()
        return worker
    except Exception as exc:
        if settings.audio_device == "default":
            log.warning("no microphone (%s); VAD and barge-in are off", exc)
            return None
        raise CosyEdgeError(f"microphone {settings.audio_device!r} cannot be opened: {exc}") from exc
