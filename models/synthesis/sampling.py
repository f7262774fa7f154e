"""Speech-token sampling with CosyVoice's rules, in numpy.

Matches upstream `ras_sampling` (repetition-aware sampling): nucleus
sampling limited to `top_k` candidates and cumulative probability `top_p`;
if the drawn token occurs in the last `win_size` decoded tokens at least
`win_size * tau_r` times, draw again from the full distribution. While the
minimum length is not reached EOS is rejected by redrawing (upstream's
`sampling_ids`, at most 100 trials). Each request owns its random generator,
so a seeded request yields the same tokens alone or in a batch."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from cosyedge_models.bundle.loader import SamplingConfig
from cosyedge_models.errors import SynthesisError

MAX_TRIALS = 100


# nucleus_candidates looks at every SAMPLE_STRIDE-th entry first: a sample of ~1100 of a 6564-entry
# vocabulary leaves ~150 candidates to sort (a full argpartition was most of a step's sampling time)
SAMPLE_STRIDE = 6
# sample_rows samples row by row below this many rows (the batched sort's overhead: 2 rows 150 against
# 132 us, 4 rows 204 against 258 us; docs/benchmarks/sampling-rows-epyc-2core-2026-12-04.json)
TOGETHER_FROM_ROWS = 4
SMALL_DRAW = 64  # draw() sums at most this many entries in Python


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
    """Inverse-CDF draw of an index from unnormalised probabilities (the float64 cumulative sum,
    the first entry above u times the total)."""
    n = probs.shape[0]
    if n <= SMALL_DRAW:
        # the same sequential float64 sums in Python: a numpy cumsum's call overhead was most of a
        # nucleus draw (14 against 3 us for 25 candidates)
        cdf = list(itertools.accumulate(probs.tolist()))
        return min(bisect.bisect_right(cdf, u * cdf[-1]), n - 1)
    cdf_np = np.cumsum(probs, dtype=np.float64)
    return min(int(np.searchsorted(cdf_np, u * cdf_np[-1], side="right")), n - 1)


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
        return self.pick(probs, *nucleus_candidates(probs, self.config.top_p, self.config.top_k), decoded)

    def pick(self, probs: np.ndarray, ids: np.ndarray, values: np.ndarray, decoded: Sequence[int]) -> int:
        """One repetition-aware draw from a step's probabilities and their nucleus candidates."""
        token = int(ids[draw(values, self.rng.random())])
        window = decoded[-self.config.win_size:] if self.config.win_size > 0 else ()
        repeats = window.count(token)
        if repeats >= self.config.win_size * self.config.tau_r:
            token = draw(probs, self.rng.random())
        return token

    def sample(self, logp: np.ndarray, decoded: Sequence[int], ignore_eos: bool) -> int:
        probs = softmax(logp)
        if not np.isfinite(probs).all():
            raise not_finite()
        return self.redraw_eos(probs, *nucleus_candidates(probs, self.config.top_p, self.config.top_k),
                               decoded, ignore_eos)

    def redraw_eos(self, probs: np.ndarray, ids: np.ndarray, values: np.ndarray, decoded: Sequence[int],
                   ignore_eos: bool) -> int:
        for _ in range(MAX_TRIALS + 1):
            token = self.pick(probs, ids, values, decoded)
            if not ignore_eos or token != self.eos_token:
                return token
        raise SynthesisError(
            f"sampling drew EOS {MAX_TRIALS} times while the minimum length was not reached; "
            "the model output is degenerate for this input"
        )


def sample_rows(samplers: Sequence[TokenSampler], logps: np.ndarray, decoded: Sequence[Sequence[int]],
                ignore_eos: Sequence[bool]) -> list[int | SynthesisError]:
    """One token per row of a batched step's logp [B, V], each row with its own sampler (its own
    random draws, in the order `TokenSampler.sample` makes them), so a row's token is the one it
    gets alone. The softmax and the nucleus candidates of all rows are computed together (row by
    row, they were most of a step's host work at eight rows); a row whose sampling fails gets its
    error in its place, the other rows their tokens."""
    n = len(samplers)
    if logps.ndim != 2 or logps.shape[0] != n or len(decoded) != n or len(ignore_eos) != n:
        raise ValueError(f"sample_rows: {n} samplers, {len(decoded)} token lists and {len(ignore_eos)} flags "
                         f"for logp of shape {logps.shape}")
    configs = {(s.config.top_p, s.config.top_k) for s in samplers}
    if n < TOGETHER_FROM_ROWS or len(configs) != 1:  # rows with their own nucleus settings: row by row
        return [_sample_one(s, lp, d, e) for s, lp, d, e in zip(samplers, logps, decoded, ignore_eos, strict=True)]
    ((top_p, top_k),) = configs
    probs = softmax_rows(logps)
    finite = np.isfinite(probs).all(axis=1)
    kept = np.flatnonzero(finite)  # a row that is not finite has no candidates: it fails alone
    ids, values, takes = nucleus_rows(probs if finite.all() else probs[kept], top_p, top_k)
    out: list[int | SynthesisError] = [0 if ok else not_finite() for ok in finite.tolist()]  # kept: below
    for j, r in enumerate(kept.tolist()):
        t = int(takes[j])
        try:
            out[r] = samplers[r].redraw_eos(probs[r], ids[j, :t], values[j, :t], decoded[r], ignore_eos[r])
        except SynthesisError as exc:
            out[r] = exc
    return out


def not_finite() -> SynthesisError:
    return SynthesisError("the LLM step's scores are not finite (NaN or all -inf): the model output is unusable "
                          "for this input")


def _sample_one(sampler: TokenSampler, logp: np.ndarray, decoded: Sequence[int],
                ignore_eos: bool) -> int | SynthesisError:
    try:
        return sampler.sample(logp, decoded, ignore_eos)
    except SynthesisError as exc:
        return exc


def softmax_rows(logp: np.ndarray) -> np.ndarray:
    """`softmax` of each row of [B, V], with the same float32 values (a row's max, exp and sum)."""
    # C order: a row's sum is then the pairwise sum `softmax` takes over it
    x = np.ascontiguousarray(logp, dtype=np.float32)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    e /= e.sum(axis=1, dtype=np.float32, keepdims=True)
    return e


def nucleus_rows(probs: np.ndarray, top_p: float, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`nucleus_candidates` of each row of [B, V]: ids and values [B, k] in the same order, and how
    many of each row's are candidates [B]."""
    order = top_order_rows(probs, min(top_k, probs.shape[1]))
    values = np.take_along_axis(probs, order, axis=1)
    limit = np.float32(top_p)
    before = np.cumsum(values, axis=1, dtype=np.float32)[:, :-1]
    takes = int(np.float32(0.0) < limit) + np.count_nonzero(before < limit, axis=1)
    return order, values, takes


def top_order_rows(probs: np.ndarray, k: int) -> np.ndarray:
    """`top_order` of each row of [B, V] as [B, k]: each row's entries at or above its strided
    sample's bound, in descending probability (ties: lowest id first, as a stable sort). One sort
    of int64 keys (row, then the probability's float32 bits reversed, then the id: a non-negative
    float32 orders as its bits) instead of two stable argsorts: half the time at 16 rows."""
    if probs.dtype != np.float32:
        raise ValueError(f"top_order_rows orders float32 probabilities by their bits, got {probs.dtype}")
    b, n = probs.shape
    id_bits, bits = max(n - 1, 1).bit_length(), 31
    if max(b - 1, 1).bit_length() + bits + id_bits > 63:
        raise ValueError(f"top_order_rows: {b} rows of {n} entries do not fit one int64 key")
    sample = probs[:, ::SAMPLE_STRIDE]
    m = sample.shape[1]
    if 0 < k < m:
        bound = np.partition(sample, m - k, axis=1)[:, m - k]
        flat = np.flatnonzero(probs >= bound[:, None])  # row-major: by row, then by id
    else:
        flat = np.arange(b * n)
    rows, ids = np.divmod(flat, n)
    reversed_bits = np.int64(2**bits - 1) - probs.reshape(-1)[flat].view(np.int32).astype(np.int64)
    keys = (rows << (bits + id_bits)) | (reversed_bits << id_bits) | ids
    keys.sort()
    starts = np.searchsorted(keys >> (bits + id_bits), np.arange(b))  # each row holds at least k entries
    return keys[starts[:, None] + np.arange(k)] & ((1 << id_bits) - 1)
