"""What the TTS server says about itself (`info`) and which engine voice a
Wyoming voice request means. Voices: the local engine's (a CosyVoice
bundle's voices, saved zero-shot voices included), or one `default` voice
when it names none."""

from __future__ import annotations

from cosyedge_daemon.synthesizers.routing import SynthesizerSet
from wyoming.info import Attribution, Info, TtsProgram, TtsVoice
from wyoming.tts import SynthesizeVoice

DEFAULT_VOICE = "default"
COSYVOICE_LANGUAGES = ["zh", "en", "ja", "ko", "yue"]  # CosyVoice 2's languages
ATTRIBUTION = Attribution(name="FunAudioLLM CosyVoice", url="https://github.com/FunAudioLLM/CosyVoice")


def _languages(engine_name: str, voice: str) -> list[str]:
    if engine_name.startswith("espeak"):
        return [voice]  # espeak-ng voice names are language tags
    return list(COSYVOICE_LANGUAGES)


def engine_voices(synthesizers: SynthesizerSet) -> tuple[str, list[str]]:
    """(engine name, its voices) of the local engine (or the fallback while it is missing)."""
    return synthesizers.served_voices()


def build_info(synthesizers: SynthesizerSet, version: str) -> Info:
    name, voices = engine_voices(synthesizers)
    listed = voices or [DEFAULT_VOICE]
    return Info(tts=[TtsProgram(
        name="cosyedge",
        description=f"cosyedge speech daemon ({name})",
        attribution=ATTRIBUTION,
        installed=True,
        version=version,
        voices=[TtsVoice(name=v, description=f"{name} voice {v}", attribution=ATTRIBUTION, installed=True,
                         version=None, languages=_languages(name if voices else "", v)) for v in listed],
        supports_synthesize_streaming=True,
    )])


def voice_for(synthesizers: SynthesizerSet, voice: SynthesizeVoice | None) -> str | None:
    """The engine voice of a request: a listed name as is (`default`: the
    engine's default), a language: the first voice that speaks it; else None
    (the default voice). An unknown name is passed on so the engine's own
    check answers it (unknown_voice)."""
    if voice is None:
        return None
    name, voices = engine_voices(synthesizers)
    if isinstance(voice.name, str) and voice.name:
        return None if voice.name == DEFAULT_VOICE else voice.name
    if isinstance(voice.language, str) and voice.language:
        for v in voices:
            if voice.language in _languages(name, v):
                return v
    return None
