"""Our numpy sampler against upstream's ras_sampling (cosyvoice.utils.common)."""

from __future__ import annotations

import numpy as np
import pytest
from cosyedge_models.bundle.loader import SamplingConfig
from cosyedge_models.errors import SynthesisError
from cosyedge_models.synthesis.sampling import (
    TokenSampler,
    draw,
    nucleus_candidates,
    sample_rows,
    softmax,
    softmax_rows,
    top_order,
    top_order_rows,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.components import require_module

torch = require_module("torch")
common = require_module("cosyvoice.utils.common")

CFG = SamplingConfig(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)


def _upstream_candidates(logp: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Upstream nucleus_sampling's candidate list, read by replacing the draw:
    multinomial returns index i, so the i-th candidate comes back."""
    recorded: dict[str, torch.Tensor] = {}
    pick = {"i": 0}
    original = torch.Tensor.multinomial

    def fake_multinomial(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        recorded["prob"] = self.clone()
        return torch.tensor([pick["i"]])

    torch.Tensor.multinomial = fake_multinomial  # type: ignore[method-assign]
    try:
        scores = torch.from_numpy(logp)
        common.nucleus_sampling(scores, top_p=CFG.top_p, top_k=CFG.top_k)
        n = recorded["prob"].shape[0]
        ids = []
        for i in range(n):
            pick["i"] = i
            ids.append(int(common.nucleus_sampling(scores, top_p=CFG.top_p, top_k=CFG.top_k)))
    finally:
        torch.Tensor.multinomial = original  # type: ignore[method-assign]
    return ids, recorded["prob"].numpy()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0, 10.0])
def test_nucleus_candidates_match_upstream(temperature: float) -> None:
    rng = np.random.default_rng(int(temperature * 10))
    for _ in range(10):
        logits = rng.standard_normal(6564).astype(np.float32) * temperature
        logp = torch.log_softmax(torch.from_numpy(logits), dim=0).numpy()
        ids, probs = nucleus_candidates(softmax(logp), CFG.top_p, CFG.top_k)
        up_ids, up_probs = _upstream_candidates(logp)
        assert ids.tolist() == up_ids
        np.testing.assert_allclose(probs, up_probs, rtol=1e-5)


def test_ties_resolve_to_lowest_ids_like_a_stable_sort() -> None:
    logp = np.log(np.full(100, 0.01, dtype=np.float32))
    ids, _ = nucleus_candidates(softmax(logp), 0.8, 25)
    up_ids, _ = _upstream_candidates(logp)
    assert ids.tolist() == up_ids == list(range(25))


def test_draw_follows_the_nucleus_distribution() -> None:
    logp = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))
    sampler = TokenSampler.seeded(SamplingConfig(top_p=0.8, top_k=25, win_size=10, tau_r=0.1), eos_token=99, seed=1)
    counts = np.zeros(5)
    for _ in range(20000):
        counts[sampler.ras(logp, decoded=[])] += 1
    # Candidates: 0.5, 0.2, 0.15 (cumulative before each < 0.8), renormalised.
    expected = np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.015)


def test_repetition_falls_back_to_the_full_distribution() -> None:
    logp = np.log(np.array([0.9, 0.04, 0.03, 0.02, 0.01], dtype=np.float32))
    sampler = TokenSampler.seeded(CFG, eos_token=99, seed=2)
    # Token 0 is the only nucleus candidate; once it is in the window every
    # draw is redone over the full distribution.
    draws = [sampler.ras(logp, decoded=[0]) for _ in range(5000)]
    share = np.bincount(draws, minlength=5) / len(draws)
    np.testing.assert_allclose(share, [0.9, 0.04, 0.03, 0.02, 0.01], atol=0.02)
    assert all(sampler.ras(logp, decoded=[]) == 0 for _ in range(50))


def test_eos_is_redrawn_until_the_minimum_length_then_gives_up() -> None:
    logp = np.log(np.array([0.3, 0.7], dtype=np.float32))
    sampler = TokenSampler.seeded(SamplingConfig(top_p=1.0, top_k=2, win_size=0, tau_r=0.1), eos_token=1, seed=3)
    assert all(sampler.sample(logp, [], ignore_eos=True) == 0 for _ in range(200))
    only_eos = np.log(np.array([1e-12, 1.0], dtype=np.float32))
    with pytest.raises(SynthesisError, match="EOS"):
        sampler.sample(only_eos, [], ignore_eos=True)


def test_same_seed_same_tokens() -> None:
    rng = np.random.default_rng(0)
    logps = [np.log(softmax(rng.standard_normal(300).astype(np.float32))) for _ in range(50)]
    runs = []
    for _ in range(2):
        s = TokenSampler.seeded(CFG, eos_token=299, seed=42)
        out: list[int] = []
        for lp in logps:
            out.append(s.sample(lp, out, ignore_eos=False))
        runs.append(out)
    assert runs[0] == runs[1]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 400), st.integers(1, 40), st.sampled_from(["flat", "ties", "peaked", "masked"]),
       st.integers(0, 2**32 - 1))
def test_top_order_is_the_prefix_of_a_full_stable_sort(n: int, k: int, kind: str, seed: int) -> None:
    """The strided bound never drops an id of the first k (ties included) that sorting the whole
    vocabulary would give."""
    rng = np.random.default_rng(seed)
    if kind == "ties":  # few distinct values: ties across the bound
        probs = rng.integers(0, 4, n).astype(np.float32)
    elif kind == "peaked":
        probs = softmax((rng.standard_normal(n) * 8).astype(np.float32))
    else:
        probs = rng.random(n).astype(np.float32)
        if kind == "masked":
            probs[rng.random(n) < 0.7] = 0.0
    k = min(k, n)
    np.testing.assert_array_equal(top_order(probs, k), np.argsort(-probs, kind="stable")[:k])


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 16), st.sampled_from([7, 300, 6564]), st.sampled_from([0.5, 3.0, 12.0]),
       st.integers(0, 2**32 - 1))
def test_rows_sampled_together_get_the_tokens_each_gets_alone(rows: int, vocab: int, scale: float,
                                                               seed: int) -> None:
    """sample_rows: each row's token and its generator's state after are those of the row's own
    sampler alone, over steps with repetitions and EOS held back on some rows."""
    rng = np.random.default_rng(seed)
    eos = vocab - 1
    together = [TokenSampler.seeded(CFG, eos, seed + r) for r in range(rows)]
    alone = [TokenSampler.seeded(CFG, eos, seed + r) for r in range(rows)]
    decoded: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(12):
        logps = np.log(softmax_rows((rng.standard_normal((rows, vocab)) * scale).astype(np.float32)) + 1e-30)
        logps = logps.astype(np.float32)
        ignore = [bool(x) for x in rng.integers(0, 2, rows)]
        got = sample_rows(together, logps, decoded, ignore)
        for r in range(rows):
            try:
                expected: int | str = alone[r].sample(logps[r], decoded[r], ignore[r])
            except SynthesisError as exc:  # EOS held back on a small vocabulary: the same error in place
                expected = str(exc)
            token = got[r]
            assert (str(token) if isinstance(token, SynthesisError) else token) == expected
            if isinstance(token, int):
                decoded[r].append(token)
    assert [s.rng.random() for s in together] == [s.rng.random() for s in alone]


def test_a_row_that_cannot_sample_fails_alone() -> None:
    """A row whose only candidate is EOS while EOS is held back gets the error in its place."""
    cfg = SamplingConfig(top_p=1.0, top_k=2, win_size=0, tau_r=0.1)
    logps = np.log(np.array([[0.3, 0.7], [1e-12, 1.0], [0.6, 0.4]], dtype=np.float32))
    samplers = [TokenSampler.seeded(cfg, eos_token=1, seed=s) for s in range(3)]
    got = sample_rows(samplers, logps, [[], [], []], [True, True, True])
    assert got[0] == 0 and got[2] == 0
    assert isinstance(got[1], SynthesisError) and "EOS" in str(got[1])


def test_rows_with_their_own_nucleus_settings_sample_row_by_row() -> None:
    wide = SamplingConfig(top_p=1.0, top_k=5, win_size=0, tau_r=0.1)
    logps = np.log(np.tile(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32), (2, 1)))
    narrow_draws, wide_draws = set(), set()
    for seed in range(200):
        got = sample_rows([TokenSampler.seeded(CFG, 99, seed), TokenSampler.seeded(wide, 99, seed)], logps,
                          [[], []], [False, False])
        narrow_draws.add(got[0])
        wide_draws.add(got[1])
    assert narrow_draws == {0, 1, 2} and wide_draws == {0, 1, 2, 3, 4}


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.floats(0.0, 1.0, exclude_max=True), st.integers(0, 2**32 - 1))
def test_a_short_draw_sums_as_numpy_does(n: int, u: float, seed: int) -> None:
    values = (np.random.default_rng(seed).random(n) ** 4).astype(np.float32)
    cdf = np.cumsum(values, dtype=np.float64)
    assert draw(values, u) == min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), n - 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 17), st.integers(1, 400), st.integers(1, 40),
       st.sampled_from(["flat", "ties", "peaked", "masked"]), st.integers(0, 2**32 - 1))
def test_top_order_rows_is_each_rows_top_order(b: int, n: int, k: int, kind: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    if kind == "ties":
        probs = rng.integers(0, 4, (b, n)).astype(np.float32)
    elif kind == "peaked":
        probs = softmax_rows((rng.standard_normal((b, n)) * 8).astype(np.float32))
    else:
        probs = rng.random((b, n)).astype(np.float32)
        if kind == "masked":
            probs[rng.random((b, n)) < 0.7] = 0.0
    k = min(k, n)
    np.testing.assert_array_equal(top_order_rows(probs, k), np.stack([top_order(row, k) for row in probs]))


@pytest.mark.parametrize("rows", [2, 6])  # row by row, and together
@pytest.mark.parametrize("bad", ["nan", "all_inf"])
def test_a_row_whose_scores_are_not_finite_fails_alone(rows: int, bad: str) -> None:
    """A NaN (or an all -inf row: an fp16 overflow) fails its own row with a clear error, last row or
    not; the others get the tokens they get alone."""
    rng = np.random.default_rng(9)
    logps = np.log(softmax_rows(rng.standard_normal((rows, 300)).astype(np.float32)))
    broken = rows - 1
    if bad == "nan":
        logps[broken, 7] = np.nan
    else:
        logps[broken] = -np.inf
    got = sample_rows([TokenSampler.seeded(CFG, 299, s) for s in range(rows)], logps, [[]] * rows,
                      [False] * rows)
    assert isinstance(got[broken], SynthesisError) and "not finite" in str(got[broken])
    for r in range(broken):
        assert got[r] == TokenSampler.seeded(CFG, 299, r).sample(logps[r], [], False)
    with pytest.raises(SynthesisError, match="not finite"):
        TokenSampler.seeded(CFG, 299, 0).sample(logps[broken], [], False)
