"""Audio features of the CosyVoice 2 frontend in numpy (no torch, torchaudio,
librosa or whisper at run time).

* `whisper_log_mel`: whisper's `log_mel_spectrogram(audio, n_mels=128)`, the
  speech tokenizer's input (n_fft 400, hop 160, periodic Hann, centred STFT
  with reflect padding, |STFT|^2 without the last frame, slaney mel filters,
  log10 clamped at 1e-10, floored at max - 8, then (x + 4) / 4).
* `kaldi_fbank`: `torchaudio.compliance.kaldi.fbank(wave, num_mel_bins=80,
  dither=0, sample_frequency=16000)` with torchaudio's defaults (25 ms povey
  window, 10 ms shift, snip edges, DC offset removed, pre-emphasis 0.97, FFT
  rounded up to a power of two, power spectrum, Kaldi mel banks from 20 Hz to
  Nyquist, log with float32 epsilon floor); `campplus_features` subtracts the
  per-bin mean over time, as upstream `_extract_spk_embedding` does.
* `matcha_mel`: `matcha.utils.audio.mel_spectrogram(y, n_fft=1920,
  num_mels=80, sampling_rate=24000, hop_size=480, win_size=1920, fmin=0,
  fmax=8000, center=False)`, the flow's prompt mel (`prompt_mel` returns it
  as [T, 80] like upstream `_extract_speech_feat`).
* `slaney_mel_filters`: librosa's `filters.mel` (slaney scale and norm).
* `resample` (soxr) and `load_audio` (soundfile), imported lazily.

All functions take float mono PCM in [-1, 1] and return float32; they are
vectorised (a 30 s prompt takes milliseconds).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import BinaryIO

import numpy as np
from cosyedge_models.errors import CosyEdgeError, RequestError

logger = logging.getLogger(__name__)

WHISPER_SAMPLE_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160
FLOW_SAMPLE_RATE = 24000
INVALID_AUDIO = "invalid_audio"


def _as_mono_f64(pcm: np.ndarray) -> np.ndarray:
    x = np.asarray(pcm, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"expected mono PCM of shape [N], got shape {x.shape}")
    return x


def _frames(x: np.ndarray, size: int, hop: int) -> np.ndarray:
    """[n_frames, size] views, n_frames = 1 + (len - size) // hop."""
    return np.lib.stride_tricks.sliding_window_view(x, size)[::hop]


def hann_window(size: int, periodic: bool = True) -> np.ndarray:
    """torch.hann_window(size, periodic) in float64."""
    if size == 1:
        return np.ones(1)
    denominator = size if periodic else size - 1
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(size) / denominator)


# --- mel scales --------------------------------------------------------------

_SLANEY_F_SP = 200.0 / 3  # Hz per mel below 1 kHz
_SLANEY_MIN_LOG_HZ = 1000.0
_SLANEY_MIN_LOG_MEL = _SLANEY_MIN_LOG_HZ / _SLANEY_F_SP
_SLANEY_LOG_STEP = np.log(6.4) / 27.0


def hz_to_mel_slaney(hz: np.ndarray | float) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz / _SLANEY_F_SP
    safe = np.maximum(hz, _SLANEY_MIN_LOG_HZ)
    log = _SLANEY_MIN_LOG_MEL + np.log(safe / _SLANEY_MIN_LOG_HZ) / _SLANEY_LOG_STEP
    return np.where(hz >= _SLANEY_MIN_LOG_HZ, log, linear)


def mel_to_hz_slaney(mel: np.ndarray | float) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    linear = mel * _SLANEY_F_SP
    log = _SLANEY_MIN_LOG_HZ * np.exp(_SLANEY_LOG_STEP * (mel - _SLANEY_MIN_LOG_MEL))
    return np.where(mel >= _SLANEY_MIN_LOG_MEL, log, linear)


def slaney_mel_filters(
    sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> np.ndarray:
    """Triangular mel filters [n_mels, n_fft // 2 + 1] float32, equal to
    librosa.filters.mel(sr=..., n_fft=..., n_mels=..., fmin=..., fmax=...)
    with its defaults (slaney scale, slaney area normalisation)."""
    if fmax is None:
        fmax = sample_rate / 2.0
    fft_hz = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    edges_hz = mel_to_hz_slaney(np.linspace(hz_to_mel_slaney(fmin), hz_to_mel_slaney(fmax), n_mels + 2))
    widths = np.diff(edges_hz)
    distance = edges_hz[:, None] - fft_hz[None, :]
    rising = -distance[:-2] / widths[:-1, None]
    falling = distance[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]
    return weights.astype(np.float32)


def kaldi_mel(hz: np.ndarray) -> np.ndarray:
    return 1127.0 * np.log1p(np.asarray(hz, dtype=np.float64) / 700.0)


def kaldi_mel_banks(
    num_bins: int, padded_window: int, sample_rate: float, low_freq: float = 20.0, high_freq: float = 0.0
) -> np.ndarray:
    """Kaldi's triangular mel banks [num_bins, padded_window // 2 + 1] (the
    last column, Nyquist, is zero as in torchaudio), float64."""
    nyquist = 0.5 * sample_rate
    if high_freq <= 0.0:
        high_freq += nyquist
    if not 0.0 <= low_freq < high_freq <= nyquist:
        raise ValueError(f"need 0 <= low_freq < high_freq <= {nyquist}, got {low_freq}, {high_freq}")
    mel_low, mel_high = kaldi_mel(np.array(low_freq)), kaldi_mel(np.array(high_freq))
    delta = (mel_high - mel_low) / (num_bins + 1)
    left = mel_low + np.arange(num_bins)[:, None] * delta
    center, right = left + delta, left + 2 * delta
    mel = kaldi_mel(sample_rate / padded_window * np.arange(padded_window // 2))[None, :]
    banks = np.maximum(0.0, np.minimum((mel - left) / (center - left), (right - mel) / (right - center)))
    return np.pad(banks, ((0, 0), (0, 1)))


# --- features ------------------------------------------------------------------

_WHISPER_FILTERS: dict[int, np.ndarray] = {}


def whisper_log_mel(audio16k: np.ndarray, n_mels: int = 128) -> np.ndarray:
    """whisper.log_mel_spectrogram(audio, n_mels) for one 16 kHz clip:
    [n_mels, len // 160] float32. Needs more than 200 samples."""
    x = _as_mono_f64(audio16k)
    pad = WHISPER_N_FFT // 2
    if x.size <= pad:
        raise ValueError(f"whisper_log_mel needs more than {pad} samples, got {x.size}")
    if n_mels not in _WHISPER_FILTERS:
        filters = slaney_mel_filters(WHISPER_SAMPLE_RATE, WHISPER_N_FFT, n_mels)
        _WHISPER_FILTERS[n_mels] = filters.astype(np.float64)
    frames = _frames(np.pad(x, pad, mode="reflect"), WHISPER_N_FFT, WHISPER_HOP)[:-1]
    spectrum = np.fft.rfft(frames * hann_window(WHISPER_N_FFT), axis=-1)
    power = spectrum.real**2 + spectrum.imag**2
    mel = _WHISPER_FILTERS[n_mels] @ power.T
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


_FLOAT32_EPS = float(np.finfo(np.float32).eps)


def kaldi_fbank(
    wave: np.ndarray,
    num_mel_bins: int = 80,
    sample_frequency: float = 16000.0,
    frame_length_ms: float = 25.0,
    frame_shift_ms: float = 10.0,
    preemphasis: float = 0.97,
    low_freq: float = 20.0,
    high_freq: float = 0.0,
) -> np.ndarray:
    """torchaudio.compliance.kaldi.fbank with dither=0 and the other defaults
    (povey window, snip_edges, remove_dc_offset, round_to_power_of_two,
    use_power, use_log_fbank, no energy): [frames, num_mel_bins] float32.
    Audio shorter than one window gives zero frames."""
    x = _as_mono_f64(wave)
    size = int(sample_frequency * frame_length_ms * 0.001)
    shift = int(sample_frequency * frame_shift_ms * 0.001)
    padded = 1 << (size - 1).bit_length()
    if x.size < size:
        return np.zeros((0, num_mel_bins), dtype=np.float32)
    frames = _frames(x, size, shift)
    frames = frames - frames.mean(axis=1, keepdims=True)
    previous = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)  # Kaldi replicates the first sample
    frames = (frames - preemphasis * previous) * hann_window(size, periodic=False) ** 0.85
    spectrum = np.fft.rfft(frames, n=padded, axis=-1)
    power = spectrum.real**2 + spectrum.imag**2
    banks = kaldi_mel_banks(num_mel_bins, padded, sample_frequency, low_freq, high_freq)
    return np.log(np.maximum(power @ banks.T, _FLOAT32_EPS)).astype(np.float32)


def campplus_features(wave16k: np.ndarray) -> np.ndarray:
    """The speaker-embedding input: 80-bin Kaldi fbank minus its mean over
    time, [frames, 80] float32."""
    feat = kaldi_fbank(wave16k, num_mel_bins=80, sample_frequency=16000.0)
    return (feat - feat.mean(axis=0, keepdims=True)).astype(np.float32)


_MATCHA_FILTERS: dict[tuple[int, int, int, float, float], np.ndarray] = {}


def matcha_mel(
    y: np.ndarray,
    n_fft: int = 1920,
    num_mels: int = 80,
    sampling_rate: int = FLOW_SAMPLE_RATE,
    hop_size: int = 480,
    win_size: int = 1920,
    fmin: float = 0.0,
    fmax: float = 8000.0,
) -> np.ndarray:
    """matcha.utils.audio.mel_spectrogram(..., center=False) for one clip:
    [num_mels, frames] float32, natural-log magnitudes clamped at 1e-5."""
    x = _as_mono_f64(y)
    pad = (n_fft - hop_size) // 2
    if x.size <= pad:
        raise ValueError(f"matcha_mel needs more than {pad} samples, got {x.size}")
    key = (sampling_rate, n_fft, num_mels, fmin, fmax)
    if key not in _MATCHA_FILTERS:
        filters = slaney_mel_filters(sampling_rate, n_fft, num_mels, fmin, fmax)
        _MATCHA_FILTERS[key] = filters.astype(np.float64)
    # torch.stft centres a shorter window inside the n_fft frame
    window = np.zeros(n_fft)
    offset = (n_fft - win_size) // 2
    window[offset:offset + win_size] = hann_window(win_size)
    frames = _frames(np.pad(x, pad, mode="reflect"), n_fft, hop_size)
    spectrum = np.fft.rfft(frames * window, axis=-1)
    magnitude = np.sqrt(spectrum.real**2 + spectrum.imag**2 + 1e-9)
    mel = _MATCHA_FILTERS[key] @ magnitude.T
    return np.log(np.maximum(mel, 1e-5)).astype(np.float32)


def prompt_mel(pcm24k: np.ndarray) -> np.ndarray:
    """The flow's prompt features [frames, 80] (upstream `_extract_speech_feat`)."""
    return np.ascontiguousarray(matcha_mel(pcm24k).T)


# --- I/O -------------------------------------------------------------------------


def _need(package: str, pin: str, purpose: str) -> CosyEdgeError:
    return CosyEdgeError(
        f"{purpose} needs the Python package '{package}'; install it with: pip install '{pin}'"
    )


def resample(pcm: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Band-limited resampling with soxr (HQ); float32 out."""
    x = np.asarray(pcm, dtype=np.float32)
    if from_rate == to_rate:
        return x.copy()
    if from_rate <= 0 or to_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {from_rate} -> {to_rate}")
    try:
        import soxr
    except ImportError as exc:
        raise _need("soxr", "soxr==1.1.0", "resampling audio") from exc
    return np.asarray(soxr.resample(x, from_rate, to_rate, quality="HQ"), dtype=np.float32)


def to_mono(pcm: np.ndarray) -> np.ndarray:
    """[N] or [N, channels] -> [N] float32 (channel mean, as upstream)."""
    x = np.asarray(pcm, dtype=np.float32)
    if x.ndim == 2:
        x = x.mean(axis=1)
    if x.ndim != 1:
        raise ValueError(f"expected PCM of shape [N] or [N, channels], got {x.shape}")
    return x


def load_audio(source: str | Path | BinaryIO) -> tuple[np.ndarray, int]:
    """Read WAV/FLAC/OGG (anything libsndfile reads) as float32 mono in
    [-1, 1] and its sample rate. Unreadable data raises RequestError
    ('invalid_audio')."""
    try:
        import soundfile
    except ImportError as exc:
        raise _need("soundfile", "soundfile==0.14.0", "reading audio files") from exc
    name = str(source) if isinstance(source, str | Path) else "audio data"
    try:
        data, rate = soundfile.read(source, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, OSError, RuntimeError, TypeError, ValueError) as exc:
        raise RequestError(INVALID_AUDIO, f"cannot read {name} as audio (WAV, FLAC, OGG): {exc}") from exc
    return to_mono(data), int(rate)
