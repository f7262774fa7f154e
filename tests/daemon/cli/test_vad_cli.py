"""`cosyedge vad` end to end: `python -m cosyedge_daemon vad` on a generated mixture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile as sf
from cosyedge_daemon.audio.pcm import resample

from tests.support.speech import load_clips, mix, require_speech_data

ROOT = Path(__file__).resolve().parents[3]


def _vad(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cosyedge_daemon", "vad", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_vad_command_prints_one_json_line_per_utterance(tmp_path: Path) -> None:
    data = require_speech_data()
    clips = load_clips(data)
    m = mix([clips["digit"], clips["sentence"]], [0.7, 3.0], 8.5, "pink", 20, seed=5)
    wav = tmp_path / "mix48k.wav"  # any WAV: 48 kHz stereo here, read as 16 kHz mono
    x = resample(m.pcm16.astype("float32") / 32768, 16000, 48000)
    sf.write(wav, np.stack([x, x], axis=1), 48000, subtype="PCM_16")
    result = _vad(str(wav))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 2, result.stdout
    for line, (start, end) in zip(lines, m.truth, strict=True):
        assert set(line) == {"start_ms", "end_ms", "duration_ms"}
        assert abs(line["start_ms"] - 1000 * start) <= 90 and abs(line["end_ms"] - 1000 * end) <= 90
        assert line["duration_ms"] == line["end_ms"] - line["start_ms"]

    config = tmp_path / "cosyedge.toml"
    config.write_text("[vad]\nhangover_ms = 3000\nmin_utterance_ms = 100\n")
    merged = _vad(str(wav), "--config", str(config), "--frame-ms", "10", "--aggressiveness", "2")
    assert merged.returncode == 0, merged.stderr
    assert len(merged.stdout.splitlines()) == 1  # a 3 s hangover joins the two utterances
    assert "aggressiveness 2, frame 10 ms, hangover 3000 ms" in merged.stderr


def test_vad_command_errors(tmp_path: Path) -> None:
    missing = _vad(str(tmp_path / "nope.wav"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"\x00\x01garbage" * 100)
    bad = _vad(str(garbage))
    assert bad.returncode == 2 and "not a readable audio file" in bad.stderr
    config = tmp_path / "bad.toml"
    config.write_text("[vad]\nframe_ms = 25\n")
    wrong = _vad(str(garbage), "--config", str(config))
    assert wrong.returncode == 2 and "[vad] frame_ms = 25: allowed values: 10, 20, 30" in wrong.stderr
