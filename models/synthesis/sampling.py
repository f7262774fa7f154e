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


def softmax(logp: np.ndarray) -> np.ndarray:
    x = logp.astype(np.float32, copy=False)
    e = np.exp(x - x.max())
    return (e / e.sum(dtype=np.float32)).astype(np.float32, copy=False)


def nucleus_candidates(probs: np.ndarray, top_p: float, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The candidate ids and their (unnormalised) probabilities, in the order
    upstream builds them: descending probability (stable for ties), taking an
    entry while the float32 sum of those before it is below top_p and fewer
    than top_k are taken."""
    k_max = min(top_k, probs.shape[0])
    # argpartition first: sorting the whole vocabulary each step is wasteful.
    if k_max < probs.shape[0]:
        part = np.argpartition(-probs, k_max - 1)[:k_max]
        # Ties at the partition boundary must resolve to the lowest ids, as a stable sort would.
        kth = probs[part].min()
        tied = np.flatnonzero(probs == kth)
        part = np.union1d(part[probs[part] > kth], tied)
        order = part[np.argsort(-probs[part], kind="stable")][:k_max]
    else:
        order = np.argsort(-probs, kind="stable")
    values = probs[order]
    before = np.concatenate(([np.float32(0.0)], np.cumsum(values, dtype=np.float32)[:-1]))
    take = int(np.count_nonzero(before < np.float32(top_p)))
    # `before` is non-decreasing, so the entries below top_p are a prefix.
    return order[:take], values[:take]


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
        repeats = sum(1 for t in window if t == token)
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
