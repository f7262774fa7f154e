"""A copy of a test bundle with a saved voice (`cosyedge voice add`), from the synthetic speech-like prompt."""

from __future__ import annotations

import shutil
from pathlib import Path

import soundfile as sf
from cosyedge_daemon.cli.voice import add_voice

from tests.models.synthesis.test_synthesizer import prompt_audio


def bundle_with_voice(bundle: Path, out: Path, seconds: float, transcript: str, name: str = "alice") -> Path:
    """`bundle` copied to `out` with the voice `name`: `seconds` of prompt audio saying `transcript`."""
    shutil.copytree(bundle, out)
    prompt = prompt_audio(seconds, 22050)
    wav = out.parent / f"{name}.wav"
    sf.write(wav, prompt.pcm, prompt.sample_rate)
    add_voice(out, name, wav, transcript)
    return out
