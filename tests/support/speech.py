"""Recorded human speech for the VAD tests, and mixtures of it with silence
and noise at known offsets. The recordings are the two WAV files that the
`auditok` 0.2.0 wheel ships in `auditok/data/` (MIT licence; a test-only
dependency): a German sentence by one speaker (44.1 kHz, clean, with long
leading and trailing silence) and the Arabic digits one to six by another
(16 kHz, with background noise). Nothing of auditok is imported or run: only
its data files are read."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cosyedge_daemon.audio.pcm import read_audio_file, resample

from tests.support.components import require_data

RATE = 16000
GERMAN = "was_der_mensch_saet_das_wird_er_vielfach_ernten_44100Hz_mono_lead_trail_silence.wav"
ARABIC = "1to6arabic_16000_mono_bc_noise.wav"


def speech_data_dir() -> Path | None:
    spec = importlib.util.find_spec("auditok")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations))) / "data"
    return d if (d / GERMAN).is_file() else None


def require_speech_data() -> Path:
    """The recordings' folder; missing (skip locally, fail under CI=true) without them."""
    return require_data(speech_data_dir(), "the speech recordings of the test dependency auditok==0.2.0")


def frame_db(x: np.ndarray, hop: int = RATE // 100) -> np.ndarray:
    n = len(x) // hop
    frames = x[: n * hop].reshape(n, hop).astype(np.float64)
    return 10 * np.log10(np.mean(frames**2, axis=1) + 1e-12)


def speech_regions(x: np.ndarray, min_gap_s: float = 0.3) -> list[tuple[float, float]]:
    """Regions of speech by energy: 10 ms frames above max(noise floor + 12 dB,
    peak - 40 dB), joined across gaps shorter than `min_gap_s`."""
    db = frame_db(x)
    threshold = max(np.percentile(db, 10) + 12.0, db.max() - 40.0)
    active = np.flatnonzero(db > threshold)
    regions: list[list[int]] = []
    for i in active:
        if regions and i - regions[-1][1] <= int(min_gap_s * 100):
            regions[-1][1] = i + 1
        else:
            regions.append([i, i + 1])
    return [(a / 100, b / 100) for a, b in regions if b - a >= 8]  # at least 80 ms


@dataclass(frozen=True)
class Clip:
    name: str
    pcm: np.ndarray  # float32 at 16 kHz, trimmed to the speech extent (by energy)


def load_clips(data_dir: Path) -> dict[str, Clip]:
    """The German sentence, its two phrases, and the loudest Arabic digit."""
    clips: dict[str, Clip] = {}
    x, rate = read_audio_file(data_dir / GERMAN)
    x = resample(x, rate, RATE)
    (s0, s1), = [r for r in speech_regions(x, min_gap_s=0.5) if r[1] - r[0] > 2.0]
    clips["sentence"] = Clip("sentence", x[int(s0 * RATE):int(s1 * RATE)])
    phrases = [r for r in speech_regions(x, min_gap_s=0.2) if s0 <= r[0] and r[1] <= s1]
    first, last = phrases[0], phrases[-1]
    clips["phrase1"] = Clip("phrase1", x[int(first[0] * RATE):int(first[1] * RATE)])
    clips["phrase2"] = Clip("phrase2", x[int(last[0] * RATE):int(last[1] * RATE)])
    y, rate = read_audio_file(data_dir / ARABIC)
    y = resample(y, rate, RATE)
    digits = speech_regions(y, min_gap_s=0.3)
    loudest = max(digits, key=lambda r: frame_db(y[int(r[0] * RATE):int(r[1] * RATE)]).max())
    clips["digit"] = Clip("digit", y[int(loudest[0] * RATE):int(loudest[1] * RATE)])
    return clips


def colored_noise(n: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Unit-RMS white or pink (1/f power) noise."""
    white = rng.standard_normal(n)
    if kind == "white":
        out = white
    elif kind == "pink":
        spec = np.fft.rfft(white)
        f = np.fft.rfftfreq(n)
        f[0] = f[1]
        out = np.fft.irfft(spec / np.sqrt(f), n)
    else:
        raise ValueError(kind)
    return (out / np.sqrt(np.mean(out**2))).astype(np.float32)


@dataclass(frozen=True)
class Mixture:
    pcm16: np.ndarray
    truth: list[tuple[float, float]]  # (start_s, end_s) of each placed clip


def mix(clips: list[Clip], offsets_s: list[float], total_s: float, noise: str | None = None,
        snr_db: float = 20.0, seed: int = 0, level_db: float = -20.0) -> Mixture:
    """Clips (each scaled to `level_db` RMS) at the given offsets in silence or
    in noise at `snr_db` below the speech level."""
    rng = np.random.default_rng(seed)
    out = np.zeros(int(total_s * RATE), dtype=np.float32)
    truth = []
    gain_speech = 10 ** (level_db / 20)
    for clip, off in zip(clips, offsets_s, strict=True):
        x = clip.pcm / np.sqrt(np.mean(clip.pcm.astype(np.float64) ** 2)) * gain_speech
        i = int(off * RATE)
        out[i:i + len(x)] += x
        truth.append((i / RATE, (i + len(x)) / RATE))
    if noise is not None:
        out += colored_noise(len(out), noise, rng) * gain_speech * 10 ** (-snr_db / 20)
    return Mixture((np.clip(out, -1, 1) * 32767).astype(np.int16), truth)
