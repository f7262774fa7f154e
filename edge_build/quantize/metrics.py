"""Error measures of a low-precision stage against fp32."""

from __future__ import annotations

import numpy as np


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """10 log10(|ref|^2 / |ref - test|^2); +inf when identical."""
    ref = np.asarray(reference, dtype=np.float64).ravel()
    err = ref - np.asarray(test, dtype=np.float64).ravel()
    noise = float(np.sum(err * err))
    signal = float(np.sum(ref * ref))
    if noise == 0.0:
        return float("inf")
    if signal == 0.0:
        return float("-inf")
    return 10.0 * float(np.log10(signal / noise))


def logits_cosine(reference: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Per-row cosine similarity of log-probabilities centred per row (the
    logits up to their additive constant). Rows [n, V] -> [n]."""
    a = np.asarray(reference, dtype=np.float64)
    b = np.asarray(test, dtype=np.float64)
    a = a - a.mean(axis=-1, keepdims=True)
    b = b - b.mean(axis=-1, keepdims=True)
    num = np.sum(a * b, axis=-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return np.where(den > 0, num / np.maximum(den, 1e-30), 1.0)


def top1_agreement(reference: np.ndarray, test: np.ndarray) -> float:
    return float(np.mean(np.argmax(reference, axis=-1) == np.argmax(test, axis=-1)))


def matched_prefix(reference: list[int], test: list[int]) -> float:
    """Fraction of the reference's steps before the first differing token
    (1.0 when the sequences are equal)."""
    n = max(len(reference), len(test))
    if n == 0:
        return 1.0
    for i in range(n):
        if i >= len(reference) or i >= len(test) or reference[i] != test[i]:
            return i / n
    return 1.0
