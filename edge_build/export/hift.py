"""The HiFT vocoder as two stages. hift_source: F0 predictor and SineGen2's
harmonic source (the additive noise is an input, so the runtime owns the
randomness). hift_decoder: the generator with the STFT of the source and
the inverse STFT as convolutions with fixed DFT bases. Weight norm is folded
into plain weights before export."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_build.export.graphs import StageGraph, TensorSpec, export_stage, module_base
from cosyedge_build.reference.modules import require
from cosyedge_models.errors import CheckpointError

FRAMES = [1, 200, 1500]  # mel frames: up to 30 s
BATCH = [1, 1, 4]


def _torch() -> Any:
    return require("torch", "torch", "exporting the vocoder")


def plain_copy(hift: Any) -> Any:
    """A copy of the generator with every weight-norm parametrization
    replaced by the weight it computes. (torch's remove_parametrizations
    edits the parametrized class, which a deep copy shares with the
    original, so the copy is unwrapped by hand.)"""
    torch = _torch()
    parametrize = torch.nn.utils.parametrize
    hift = copy.deepcopy(hift).eval()
    for module in list(hift.modules()):
        if not parametrize.is_parametrized(module):
            continue
        with torch.no_grad():
            values = {name: getattr(module, name).detach().clone() for name in module.parametrizations}
        module.__class__ = module.__class__.__bases__[0]  # the original class (Conv1d, ...)
        del module._modules["parametrizations"]
        for name, value in values.items():
            module.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
    return hift


def upsample_factor(hift: Any) -> int:
    return int(
        np.prod(
            hift.f0_upsamp.scale_factor
            if np.ndim(hift.f0_upsamp.scale_factor)
            else [hift.f0_upsamp.scale_factor]
        )
    )


def _check(hift: Any) -> None:
    if type(hift.m_source).__name__ != "SourceModuleHnNSF2":
        raise CheckpointError(
            f"HiFT source module {type(hift.m_source).__name__} (a {hift.sampling_rate} Hz "
            f"CosyVoice 1 vocoder); CosyVoice 2's is SourceModuleHnNSF2 at 24 kHz"
        )
    if hift.m_source.l_sin_gen.flag_for_pulse:
        raise CheckpointError("SineGen2 with flag_for_pulse is not supported")


def linear_upsample(torch: Any, x: Any, factor: int) -> Any:
    """F.interpolate(x, scale_factor=factor, mode='linear') on [B, C, T]
    (align_corners=False), written out so that every step is an
    element-wise op: source index (i + 0.5) / factor - 0.5, clamped at 0."""
    t = x.shape[-1]
    scale = torch.tensor(1.0 / factor, dtype=torch.float32)
    dst = torch.arange(t * factor).float()
    src = torch.clamp(scale * (dst + 0.5) - 0.5, min=0.0)
    i0 = torch.floor(src).long()
    lam1 = src - i0.float()
    i1 = torch.clamp(i0 + 1, max=t - 1)
    return x[..., i0] * (1.0 - lam1) + x[..., i1] * lam1


# cumsum split: multiples of 2^-12 below 1 add up exactly in float32 for
# 4096 frames (82 s); the small remainders carry little rounding error
_CUMSUM_STEP = 2.0**-12


def accurate_cumsum(torch: Any, x: Any) -> Any:
    """cumsum over dim 1 of values in [0, 1), close to the correctly rounded
    prefix sums that torch's CPU cumsum (double accumulator) returns, with
    float32 ops only (TensorRT has no double). A plain float32 cumsum drifts
    by ~1 rad of the 9th harmonic's phase over 30 s."""
    coarse = torch.floor(x * (1.0 / _CUMSUM_STEP)) * _CUMSUM_STEP
    return torch.cumsum(coarse, dim=1) + torch.cumsum(x - coarse, dim=1)


def make_source_graph(hift: Any) -> Any:
    torch = _torch()
    _check(hift)
    hift = plain_copy(hift)
    factor = upsample_factor(hift)
    gen = hift.m_source.l_sin_gen

    class SourceGraph(module_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.hift = hift
            self.register_buffer("harmonics", torch.arange(1, gen.harmonic_num + 2).float(), persistent=False)

        def forward(self, mel: Any, noise: Any) -> Any:
            f0 = self.hift.f0_predictor(mel)  # [B, T]
            b, t = f0.shape[0], f0.shape[1]
            # per frame: what SineGen2 reads back after its linear down-sampling
            # (both neighbours lie in the same frame, so it is that frame's value)
            rad = (f0.unsqueeze(-1) * self.harmonics / gen.sampling_rate) % 1  # [B, T, H]
            phase = accurate_cumsum(torch, rad) * 2 * math.pi
            phase = linear_upsample(torch, phase.transpose(1, 2) * factor, factor).transpose(1, 2)
            sines = torch.sin(phase) * gen.sine_amp  # [B, T*U, H]
            uv = (f0 > gen.voiced_threshold).float()
            uv = uv.unsqueeze(-1).expand(b, t, factor).reshape(b, t * factor, 1)
            noise_amp = uv * gen.noise_std + (1 - uv) * gen.sine_amp / 3
            waves = sines * uv + noise_amp * noise
            source = self.hift.m_source.l_tanh(self.hift.m_source.l_linear(waves))
            return source.transpose(1, 2)

    return SourceGraph().eval()


def dft_bases(n_fft: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Periodic Hann window; forward kernels [2F, 1, n_fft] (real rows, then
    imaginary rows, like torch.stft); inverse kernels [2F, 1, n_fft] (one-sided
    irfft times the window, like torch.istft before its normalisation)."""
    n = np.arange(n_fft)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * n / n_fft)
    bins = n_fft // 2 + 1
    k = np.arange(bins)[:, None]
    angle = 2 * np.pi * k * n[None, :] / n_fft
    forward = np.concatenate([np.cos(angle) * window, -np.sin(angle) * window])
    weight = np.full((bins, 1), 2.0)
    weight[0] = 1.0
    if n_fft % 2 == 0:
        weight[-1] = 1.0
    sin_part = np.sin(angle)
    sin_part[0] = 0.0  # irfft ignores the imaginary part of DC and Nyquist
    if n_fft % 2 == 0:
        sin_part[-1] = 0.0
    inverse = np.concatenate([weight * np.cos(angle), -weight * sin_part]) * window / n_fft
    return (
        window.astype(np.float32),
        forward[:, None, :].astype(np.float32),
        inverse[:, None, :].astype(np.float32),
    )


def make_decoder_graph(hift: Any) -> Any:
    torch = _torch()
    F = torch.nn.functional
    _check(hift)
    hift = plain_copy(hift)
    n_fft, hop = int(hift.istft_params["n_fft"]), int(hift.istft_params["hop_len"])
    window, forward_basis, inverse_basis = dft_bases(n_fft)

    class DecoderGraph(module_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.hift = hift
            self.register_buffer("forward_basis", torch.from_numpy(forward_basis), persistent=False)
            self.register_buffer("inverse_basis", torch.from_numpy(inverse_basis), persistent=False)
            self.register_buffer("window_sq", torch.from_numpy(window**2).view(1, 1, -1), persistent=False)

        def stft(self, x: Any) -> Any:  # [B, L] -> [B, 2F, L / hop + 1], center=True, reflect padding
            x = F.pad(x.unsqueeze(1), (n_fft // 2, n_fft // 2), mode="reflect")
            return F.conv1d(x, self.forward_basis, stride=hop)

        def istft(self, magnitude: Any, phase: Any) -> Any:
            spec = torch.cat((magnitude * torch.cos(phase), magnitude * torch.sin(phase)), dim=1)
            frames = spec.shape[-1]
            y = F.conv_transpose1d(spec, self.inverse_basis, stride=hop)  # windowed overlap-add
            ones = torch.ones(1, 1, frames, dtype=spec.dtype)
            envelope = F.conv_transpose1d(ones, self.window_sq, stride=hop)
            length = hop * (frames - 1)
            return (y / envelope)[:, 0, n_fft // 2 : n_fft // 2 + length]

        def forward(self, mel: Any, source: Any) -> Any:
            g = self.hift
            s = self.stft(source.squeeze(1))
            x = g.conv_pre(mel)
            for i in range(g.num_upsamples):
                x = F.leaky_relu(x, g.lrelu_slope)
                x = g.ups[i](x)
                if i == g.num_upsamples - 1:
                    x = g.reflection_pad(x)
                si = g.source_resblocks[i](g.source_downs[i](s))
                x = x + si
                xs = g.resblocks[i * g.num_kernels](x)
                for j in range(1, g.num_kernels):
                    xs = xs + g.resblocks[i * g.num_kernels + j](x)
                x = xs / g.num_kernels
            x = g.conv_post(F.leaky_relu(x))
            bins = n_fft // 2 + 1
            magnitude = torch.clamp(torch.exp(x[:, :bins, :]), max=1e2)
            phase = torch.sin(x[:, bins:, :])
            audio = self.istft(magnitude, phase)
            return torch.clamp(audio, -g.audio_limit, g.audio_limit)

    return DecoderGraph().eval()


def export_hift(hift: Any, out: Path) -> list[StageGraph]:
    torch = _torch()
    c = int(hift.f0_predictor.condnet[0].in_channels)
    factor = upsample_factor(hift)
    harmonics = int(hift.nb_harmonics) + 1
    samples = f"T*{factor}"
    source_stage = StageGraph(
        "hift_source",
        "hift_source.onnx",
        [
            TensorSpec("mel", "float32", ("B", c, "T")),
            TensorSpec("noise", "float32", ("B", samples, harmonics)),
        ],
        [TensorSpec("source", "float32", ("B", 1, samples))],
        {"B": BATCH, "T": FRAMES},
    )
    frames = 6
    export_stage(
        make_source_graph(hift),
        (torch.randn(2, c, frames), torch.randn(2, frames * factor, harmonics)),
        out,
        source_stage,
    )
    decoder_stage = StageGraph(
        "hift_decoder",
        "hift_decoder.onnx",
        [TensorSpec("mel", "float32", ("B", c, "T")), TensorSpec("source", "float32", ("B", 1, samples))],
        [TensorSpec("audio", "float32", ("B", samples))],
        {"B": BATCH, "T": FRAMES},
    )
    export_stage(
        make_decoder_graph(hift),
        (torch.randn(2, c, frames), torch.randn(2, 1, frames * factor) * 0.1),
        out,
        decoder_stage,
    )
    return [source_stage, decoder_stage]
