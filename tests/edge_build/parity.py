"""Helpers for comparing exported graphs with the upstream modules."""

from __future__ import annotations

from typing import Any

import numpy as np

# fp32 graphs against the fp32 reference
TOLERANCE = 1e-4


def max_rel(actual: Any, expected: Any) -> float:
    """max|a - b| / max|b|: the error relative to the reference's scale."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != reference {b.shape}"
    assert np.isfinite(a).all(), "non-finite values in the exported graph's output"
    scale = np.abs(b).max()
    assert scale > 0, "the reference is all zeros: the comparison would prove nothing"
    return float(np.abs(a - b).max() / scale)


def to_numpy(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy()


def upstream_source_noise(torch: Any, batch: int, samples: int, harmonics: int) -> Any:
    """The draws upstream's SineGen2 makes after the caller seeded torch: the
    random initial phase (rand [B, H], which our graph does not take), then
    randn_like of its [B, T*U, H] sine tensor, which is a transposed view of a
    [B, H, T*U] buffer, so the normals fill it in that memory order."""
    torch.rand(batch, harmonics)
    return torch.randn_like(torch.empty(batch, harmonics, samples).transpose(1, 2))


def empty_estimator_caches(manifest: dict[str, Any], batch: int = 2) -> dict[str, np.ndarray]:
    """The flow estimator's cache feeds of an offline call (no history)."""
    d = manifest["stages"]["flow_estimator"]["cache"]
    return {
        "att_cache": np.zeros((0, d["blocks"], 2, batch, d["heads"], d["head_dim"]), np.float32),
        "conv_cache": np.zeros((d["convs"], batch, d["conv_channels"], d["conv_history"]), np.float32),
        "commit": np.zeros(0, np.float32),
    }


def empty_encoder_caches(manifest: dict[str, Any], batch: int = 1) -> dict[str, np.ndarray]:
    """The flow encoder's cache feeds of an offline call (no history)."""
    d = manifest["stages"]["flow_encoder"]["cache"]
    kv = (2, batch, d["heads"], d["head_dim"])
    return {
        "enc_cache": np.zeros((0, d["layers"], *kv), np.float32),
        "up_cache": np.zeros((0, d["up_layers"], *kv), np.float32),
        "pre_cache": np.zeros((batch, d["pre_channels"], d["pre_history"]), np.float32),
        "upconv_cache": np.zeros((batch, d["upconv_channels"], d["upconv_history"]), np.float32),
        "commit": np.zeros(0, np.float32),
    }
