"""`cosyedge voice add/list` and `cosyedge synth` on a copy of the tiny bundle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from cosyedge_daemon.cli.voice import add_voice
from cosyedge_models.errors import RequestError
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.synthesizer import load_synthesizer

from tests.models.synthesis.test_synthesizer import prompt_audio

ROOT = Path(__file__).resolve().parents[3]


def test_add_a_voice_then_clone_it(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    prompt = prompt_audio(2.5, 22050)
    wav = tmp_path / "alice.wav"
    sf.write(wav, prompt.pcm, prompt.sample_rate)
    path = add_voice(bundle, "alice", wav, "Hello, this is Alice speaking.")
    assert path.exists()
    with pytest.raises(RequestError, match="voice name"):
        add_voice(bundle, "../evil", wav, "x")
    engine = load_synthesizer(bundle)
    try:
        assert "alice" in engine.voices()
        chunks = list(engine.synthesize(SynthesisRequest(text="Cloned.", mode="zero_shot", voice="alice", seed=3)))
        assert np.concatenate([c.pcm for c in chunks]).size > 0
    finally:
        engine.close()
    listing = subprocess.run([sys.executable, "-m", "cosyedge_daemon", "voice", "list", "--bundle", str(bundle)],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "alice: all modes" in listing and "default (default): sft only" in listing


def test_synth_cli_writes_a_wav(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.wav"
    res = subprocess.run([sys.executable, "-m", "cosyedge_daemon", "synth", "Hello there.",
                          "--bundle", str(tiny_bundle), "--out", str(out), "--stream"],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    data, sr = sf.read(out)
    assert sr == 24000 and data.size > 0 and "RTF" in res.stderr
    bad = subprocess.run([sys.executable, "-m", "cosyedge_daemon", "synth", "Hi", "--bundle", str(tmp_path),
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "no manifest.json" in bad.stderr
