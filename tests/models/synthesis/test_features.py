"""numpy audio features against their references: librosa's mel filters,
whisper's log_mel_spectrogram (re-implemented here with torch.stft, from
whisper/audio.py), kaldi-native-fbank for torchaudio's Kaldi fbank, and
matcha's mel_spectrogram from the reference package."""

from __future__ import annotations

import io
from pathlib import Path

import cosyedge_models.synthesis.features as features
import numpy as np
import pytest
from cosyedge_models.errors import RequestError

from tests.support.components import require_module

torch = require_module("torch")
librosa = require_module("librosa")


def _speechlike(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """Harmonics with a moving pitch, noise bursts and a silent gap."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    x = sum(0.2 / k * np.sin(k * phase) for k in range(1, 8))
    x = x * (0.5 + 0.5 * np.sin(2 * np.pi * 2 * t) ** 2) + 0.02 * rng.standard_normal(t.size)
    x[int(0.3 * t.size) : int(0.4 * t.size)] = 0.0
    return np.asarray(x, dtype=np.float32)


@pytest.mark.parametrize(
    ("rate", "n_fft", "n_mels", "fmin", "fmax"),
    [
        (16000, 400, 128, 0.0, None),
        (16000, 400, 80, 0.0, None),
        (24000, 1920, 80, 0.0, 8000.0),
        (22050, 1024, 80, 0.0, 8000.0),
        (44100, 2048, 100, 50.0, 16000.0),
    ],
)
def test_slaney_filters_match_librosa(
    rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float | None
) -> None:
    ours = features.slaney_mel_filters(rate, n_fft, n_mels, fmin, fmax)
    ref = librosa.filters.mel(sr=rate, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-8)


def _whisper_reference(audio: np.ndarray, n_mels: int) -> np.ndarray:
    # whisper/audio.py log_mel_spectrogram, with its mel_filters.npz being
    # librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels)
    x = torch.from_numpy(audio)[None]
    stft = torch.stft(x, 400, 160, window=torch.hann_window(400), return_complex=True)
    magnitudes = stft[..., :-1].abs() ** 2
    filters = torch.from_numpy(librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels))
    mel_spec = filters @ magnitudes
    log_spec = torch.clamp(mel_spec, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0)[0].numpy()


@pytest.mark.parametrize("n_mels", [128, 80])
@pytest.mark.parametrize("seconds", [0.013, 0.5, 3.0, 10.0])
def test_whisper_log_mel(n_mels: int, seconds: float) -> None:
    audio = _speechlike(seconds, 16000, seed=int(seconds * 10))
    ours = features.whisper_log_mel(audio, n_mels=n_mels)
    ref = _whisper_reference(audio, n_mels)
    assert ours.shape == ref.shape == (n_mels, audio.size // 160)
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_whisper_log_mel_silence_and_short() -> None:
    silent = features.whisper_log_mel(np.zeros(1600, np.float32))
    np.testing.assert_allclose(silent, _whisper_reference(np.zeros(1600, np.float32), 128))
    with pytest.raises(ValueError, match="more than 200 samples"):
        features.whisper_log_mel(np.zeros(200, np.float32))
    with pytest.raises(ValueError, match="mono"):
        features.whisper_log_mel(np.zeros((2, 1600), np.float32))


def _knf_fbank(audio: np.ndarray) -> np.ndarray:
    knf = require_module("kaldi_native_fbank")
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.frame_opts.samp_freq = 16000
    opts.mel_opts.num_bins = 80
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(16000, audio.tolist())
    fbank.input_finished()
    if fbank.num_frames_ready == 0:
        return np.zeros((0, 80), np.float32)
    return np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])


@pytest.mark.parametrize("n", [399, 400, 401, 560, 16000, 160000])
def test_kaldi_fbank_matches_kaldi_native_fbank(n: int) -> None:
    audio = _speechlike(n / 16000 + 1e-9, 16000, seed=n)[:n]
    ours = features.kaldi_fbank(audio)
    ref = _knf_fbank(audio)
    assert ours.shape == ref.shape == (0 if n < 400 else 1 + (n - 400) // 160, 80)
    if ref.size:
        assert np.abs(ours - ref).max() < 1e-3


def test_kaldi_fbank_louder_and_silent() -> None:
    audio = np.clip(_speechlike(2.0, 16000, seed=7) * 4, -1, 1)
    assert np.abs(features.kaldi_fbank(audio) - _knf_fbank(audio)).max() < 1e-3
    silent = np.zeros(4000, np.float32)
    np.testing.assert_allclose(features.kaldi_fbank(silent), _knf_fbank(silent), atol=1e-3)


def test_campplus_features_are_mean_normalised() -> None:
    audio = _speechlike(2.0, 16000, seed=3)
    feat = features.campplus_features(audio)
    ref = _knf_fbank(audio)
    np.testing.assert_allclose(feat, ref - ref.mean(axis=0, keepdims=True), atol=1e-3)
    np.testing.assert_allclose(feat.mean(axis=0), 0.0, atol=1e-4)


@pytest.mark.parametrize("seconds", [0.05, 1.0, 10.0])
def test_matcha_mel_matches_reference(seconds: float) -> None:
    matcha_audio = require_module("matcha.utils.audio")
    audio = _speechlike(seconds, 24000, seed=5)
    ref = matcha_audio.mel_spectrogram(
        torch.from_numpy(audio)[None],
        n_fft=1920,
        num_mels=80,
        sampling_rate=24000,
        hop_size=480,
        win_size=1920,
        fmin=0,
        fmax=8000,
        center=False,
    )[0].numpy()
    ours = features.matcha_mel(audio)
    assert ours.shape == ref.shape == (80, audio.size // 480)
    assert np.abs(ours - ref).max() < 1e-4
    assert features.prompt_mel(audio).shape == (audio.size // 480, 80)


def test_matcha_mel_shorter_window() -> None:
    matcha_audio = require_module("matcha.utils.audio")
    audio = _speechlike(1.0, 22050, seed=9)
    kw = {
        "n_fft": 1024,
        "num_mels": 80,
        "sampling_rate": 22050,
        "hop_size": 256,
        "win_size": 800,
        "fmin": 0,
        "fmax": 8000,
    }
    matcha_audio.mel_basis.clear()  # its cache is keyed by fmax only
    ref = matcha_audio.mel_spectrogram(torch.from_numpy(audio)[None], center=False, **kw)[0].numpy()
    matcha_audio.mel_basis.clear()
    assert np.abs(features.matcha_mel(audio, **kw) - ref).max() < 1e-4


def test_resample() -> None:
    rate = 48000
    t = np.arange(rate) / rate
    tone = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    for target in (16000, 24000):
        out = features.resample(tone, rate, target)
        assert out.dtype == np.float32 and abs(out.size - target) <= 1
        spectrum = np.abs(np.fft.rfft(out[1000:-1000] * np.hanning(out.size - 2000)))
        peak_hz = np.argmax(spectrum) * target / (out.size - 2000)
        assert abs(peak_hz - 1000) < 5
        assert abs(np.sqrt(np.mean(out[1000:-1000] ** 2)) - 0.5 / np.sqrt(2)) < 0.01
    same = features.resample(tone, rate, rate)
    np.testing.assert_array_equal(same, tone)
    # above the new Nyquist: removed, not aliased
    high = np.sin(2 * np.pi * 10000 * t).astype(np.float32)
    assert np.sqrt(np.mean(features.resample(high, rate, 16000)[1000:-1000] ** 2)) < 0.01


@pytest.mark.parametrize(("fmt", "subtype"), [("WAV", "PCM_16"), ("WAV", "PCM_24"), ("FLAC", "PCM_16")])
def test_load_audio(tmp_path: Path, fmt: str, subtype: str) -> None:
    soundfile = require_module("soundfile")
    left = _speechlike(0.5, 22050, seed=1)
    right = _speechlike(0.5, 22050, seed=2)
    path = tmp_path / f"a.{fmt.lower()}"
    soundfile.write(path, np.stack([left, right], axis=1), 22050, format=fmt, subtype=subtype)
    pcm, rate = features.load_audio(path)
    assert rate == 22050 and pcm.dtype == np.float32 and pcm.shape == left.shape
    np.testing.assert_allclose(pcm, (left + right) / 2, atol=2e-4)
    buffer = io.BytesIO(path.read_bytes())
    pcm2, _ = features.load_audio(buffer)
    np.testing.assert_array_equal(pcm, pcm2)


def test_load_audio_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF not really a wave file")
    with pytest.raises(RequestError) as info:
        features.load_audio(bad)
    assert info.value.code == "invalid_audio" and "bad.wav" in str(info.value)
    with pytest.raises(RequestError):
        features.load_audio(tmp_path / "missing.wav")
    with pytest.raises(RequestError):
        features.load_audio(io.BytesIO(b"\x00" * 100))
