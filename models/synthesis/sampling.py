"""Speech-token sampling with CosyVoice's rules, in numpy.

Matches upstream `ras_sampling` (repetition-aware sampling): nucleus
sampling limited to `top_k` candidates and cumulative probability `top_p`;
if the drawn token occurs in the last `win_size` decoded tokens at least
`win_size * tau_r` times, draw again from the full distribution. While the
minimum length is not reached EOS is rejected by redrawing (upstream's
`sampling_ids`, at most 100 trials). Each request owns its random generator,
so a seeded request yields the same tokens alone or in a batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from cosyedge_models.bundle.loader import SamplingConfig
from cosyedge_models.errors import SynthesisError

MAX_TRIALS = 100


# nucleus_candidates looks at every SAMPLE_STRIDE-th entry first: a sample of ~1100 of a 6564-entry
# vocabulary leaves ~150 candidates to sort (a full argpartition was most of a step's sampling time)
SAMPLE_STRIDE = 6


def softmax(logp: np.ndarray) -> np.ndarray:
    x = logp.astype(np.float32, copy=False)
    e = np.exp(x - x.max())  # a new array: the in-place ops below keep the same float32 values
    e /= e.sum(dtype=np.float32)
    return e


def nucleus_candidates(probs: np.ndarray, top_p: float, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The candidate ids and their (unnormalised) probabilities, in the order
    upstream builds them: descending probability (stable for ties), taking an
    entry while the float32 sum of those before it is below top_p and fewer
    than top_k are taken."""
    order = top_order(probs, min(top_k, probs.shape[0]))
    values = probs[order]
    # the sum before entry i is 0 for the first, cumsum[i - 1] after; it is non-decreasing, so the
    # entries below top_p are a prefix
    limit = np.float32(top_p)
    before = np.cumsum(values, dtype=np.float32)[:-1]
    take = int(np.float32(0.0) < limit) + int(np.count_nonzero(before < limit))
    return order[:take], values[:take]


def top_order(probs: np.ndarray, k: int) -> np.ndarray:
    """The first k ids of a stable descending sort of `probs` (ties: lowest id first), without
    sorting the whole vocabulary: the k-th largest of every SAMPLE_STRIDE-th entry is at most the
    k-th largest of all, so the entries at or above it (found in id order) hold those k ids with
    every tie, and a stable sort of just them gives the same prefix."""
    n = probs.shape[0]
    sample = probs[::SAMPLE_STRIDE]
    m = sample.shape[0]
    if 0 < k < m:
        bound = np.partition(sample, m - k)[m - k]
        ids = np.flatnonzero(probs >= bound)
    else:
        ids = np.arange(n)
    return ids[np.argsort(-probs[ids], kind="stable")[:k]]


def draw(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw of an index from unnormalised probabilities."""
    cdf = np.cumsum(probs, dtype=np.float64)
    idx = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(idx, probs.shape[0] - 1)


@dataclass
class TokenSampler:
    """Samples one speech token per step for one request."""

    config: SamplingConfig
    eos_token: int
    rng: np.random.Generator

    @classmethod
    def seeded(cls, config: SamplingConfig, eos_token: int, seed: int) -> TokenSampler:
        return cls(config, eos_token, np.random.default_rng(seed))

    def ras(self, logp: np.ndarray, decoded: Sequence[int]) -> int:
        probs = softmax(logp)
        ids, values = nucleus_candidates(probs, self.config.top_p, self.config.top_k)
        token = int(ids[draw(values, self.rng.random())])
        window = decoded[-self.config.win_size:] if self.config.win_size > 0 else ()
        repeats = window.count(token)
        if repeats >= self.config.win_size * self.config.tau_r:
            token = draw(probs, self.rng.random())
        return token

    def sample(self, logp: np.ndarray, decoded: Sequence[int], ignore_eos: bool) -> int:
        for _ in range(MAX_TRIALS + 1):
            token = self.ras(logp, decoded)
            if not ignore_eos or token != self.eos_token:
                return token
        raise SynthesisError(
            f"sampling drew EOS {MAX_TRIALS} times while the minimum length was not reached; "
            "the model output is degenerate for this input"
        )
